"""Probe (issue 13, WebShop): does GRPO learn WebShop once the product click is learnable? The main settings'
WebShop command (scripts/reproduce.py SETTINGS, GRPO, outcome) with the results pages rendered on the policy's side
as item1, item2, ... (envs.PositionNamedResults: the env's text, rules and rewards unchanged, clicks mapped back to
the ASIN). Writes an ordinary run directory; its line 0 is the aliased warm start (model_screen.py ws_h128_alias).

    python results/diagnosis/alias_rl.py 0 /tmp/ws_alias_s0      # seed, output directory
    python results/diagnosis/alias_rl.py 0 /tmp/ws_alias_e8_s0 --warm-start-epochs 8   # then rspo.py flags to override
    python results/diagnosis/alias_rl.py 0 /tmp/ws_copy_s0 --copy   # the policy with model_screen.copy_bias
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "scripts")]
import model_screen  # noqa: E402
import reproduce  # noqa: E402
import rspo  # noqa: E402

if __name__ == "__main__":
    seed, out, *extra = sys.argv[1:]
    model_screen.alias_results()
    if "--copy" in extra:
        extra.remove("--copy")
        build = rspo.build_policy

        def build_with_copy(*args, **kwargs):
            policy = build(*args, **kwargs)
            model_screen.copy_bias(policy)
            return policy
        rspo.build_policy = build_with_copy
    rspo.main([*reproduce.SETTINGS["webshop"], "--algo", "grpo", "--method", "outcome", "--seed", seed,
               "--output-dir", out, "--no-save-model", "--no-progress", *extra])
