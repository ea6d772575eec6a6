"""Probe (not an rspo.py change): the base learner with a policy-side state memory in its compact prompt.

    python results/diagnosis/memory_prompt.py <rspo.py flags, including --history 30>

Runs rspo.main unchanged except for the compact prompt, which becomes
    task : T . inventory : <held object + clean/hot/cool flags, or nothing> . history : <last 2 actions> . observation : O
The inventory is derived from the agent's OWN past actions only (take X from Y -> holds X; move X to Y -> nothing;
clean/heat/cool X with Y -> flag), never from the environment's hidden state; constrained decoding makes every
action admissible, so every action took effect. --history 30 hands the whole action list to the prompt builder
(the rendered history stays the last 2 actions, as in the base). All words are in the tiny vocabulary.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import rspo  # noqa: E402

SHOWN = 2
FLAGS = {"clean": "clean", "heat": "hot", "cool": "cool"}
_original = rspo.build_prompt


def inventory(actions):
    held, flags = None, []
    for a in actions:
        if a.startswith("take ") and " from " in a:
            held, flags = a[len("take "):].split(" from ")[0], []
        elif a.startswith(("move ", "put ")) and held is not None:
            held, flags = None, []
        else:
            verb = a.split(" ")[0]
            if verb in FLAGS and held is not None and a[len(verb) + 1:].startswith(held + " with "):
                flags.append(FLAGS[verb])
    return "nothing" if held is None else " ".join([held] + flags)


def build_prompt(task, history, obs, admissible, step, compact, env):
    if not compact:
        return _original(task, history, obs, admissible, step, compact, env)
    assert len(history) == step, "memory_prompt.py needs --history >= --max-steps (the whole action list)"
    actions = [a for _, a in history]
    shown = " ; ".join(actions[-SHOWN:]) or "nothing"
    return f"task : {task} . inventory : {inventory(actions)} . history : {shown} . observation : {obs}"


rspo.build_prompt = build_prompt

if __name__ == "__main__":
    rspo.main()
