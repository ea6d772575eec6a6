"""Text environments for RSPO: offline ALFWorld and WebShop that speak the real benchmarks' text, and adapters
to the real benchmarks when installed. Standard library only; docs/environments.md is the user's guide.

    env = make_env("alfworld", split="train", seed=3)             # task seed % 5000 of the split's fixed list
    obs, info = env.reset()
    obs, reward, done, info = env.step(info["admissible_actions"][0])
    env = make_env("webshop", split="test", seed=0, max_steps=20)   # options as keywords (see make_env)
    layout = generate_layout("valid_unseen", 7, num_receptacles=4)  # a dict (format: ALFWorldEnv), or your own
    env = ALFWorldEnv.from_layout(layout)                           # check_layout rejects a bad one
    env = make_env("alfworld", backend="real", game_files=[write_game_file(layout, "g/game.tw-pddl")])

Every env: reset() -> (obs, info), step(action) -> (obs, reward, done, info), expert_action() (a scripted
expert planning on the full state) and, offline, searching_action() (planning on what an agent has seen).
info: admissible_actions (sorted), won, score, task, task_type, progress, dense_reward. Any string is an
action; one the env does not understand gets the benchmark's answer and costs a step. progress is aligned
and state-based: in [0, 1], 1.0 exactly when won; it can go down, and no loop farms it. dense_reward is
imperfect on purpose, like a learned process-reward model: re-earnable events, not a potential difference,
so loops pay and a policy trained on it alone farms it instead of finishing (the failure RSPO's paper shows).

ALFWorld (ALFWorldEnv): kitchens, bathrooms, bedrooms and living rooms from ALFRED's vocabulary and tables
(copied from alfworld.gen.constants), with the alfworld==0.4.2 engine's (TextWorld + PDDL) text, admissible
commands, preconditions, reward and end; grammar="put" gives the older `put X in/on Y`.
  Verified: test_rspo.py writes random layouts as game files, plays the same actions (expert, random,
    invalid) in the real engine and asserts the same observation, admissible commands, won, done,
    progress, dense_reward and expert action at every step.
  Left out: knives (no slice); objects inside movable receptacle objects (0.4.2's domain comments it out).
  Splits: task i is built from random.Random("alfworld/<split>/<i>"), type task_types[i % len(task_types)].
    train (5,000) and valid_seen (140) share (type, object, receptacle or lamp) combinations; valid_unseen
    (134) has only the held-out ones: index % 5 == 2 of each type's sorted list.
  Size: 6 receptacles, 2 distractors, 50 steps; random admissible play wins 3.5 % (docs/environments.md: why).
  progress: a point per stage a target reached (held; treated, if asked; held at the goal receptacle; all
    points once placed there finished), the best k (2 for pick_two, one receptacle) over the maximum; look
    tasks: holding it, a lamp on, holding it at a lamp, at a lit one (/4).
  dense_reward: +0.2 for taking a target, giving it the asked treatment, arriving at the goal receptacle (or
    the lamp's) holding one, moving one into it, turning the lamp on holding one; the win adds nothing.

WebShop (WebShopEnv): the real WebAgentTextEnv (princeton-nlp/WebShop) needs 1.18M products, Java and spaCy;
this is a small generated shop with its pages, clickables, transitions and reward formula.
  Catalog (random.Random(CATALOG_SEED)): num_products (1,000) in 5 categories; each a type, brand, 3-4
    attributes, 0-2 option groups of 2-4 values (none with no_options_prob, 0.15), a price `$12.0` or range
    `$10.0 to $25.5` (rewarded at a fixed draw inside it), a description, bullets, 0-2 reviews.
  Goals as get_synthetic_goals: 1-3 attributes in a template, ` with color: x, and size: y` (groups sorted),
    `, and price lower than 40.00 dollars` (the larger of two draws from the first four multiples of 10 above
    the price); goals_per_product (6) each, cycling its option combinations. Shuffled once: test = goals
    0-499, dev = 500-1499, train = the rest.
  Search: BM25 (k1 0.9, b 0.4, Lucene idf, as pyserini) over title and attributes, lower-cased \\w+ tokens,
    top 50, ties in catalog order; search[...] works from any page.
  Pages: visible texts joined by ` [SEP] `, listed in docs/environments.md; Rating is always N.A.; after buy
    now only `Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] 0.75`.
    admissible_actions: click[x] per clickable; on the search page four queries (the instruction, it without
    the price clause, attributes + product type, the product type).
  Reward (webshop_reward): goal.py's get_reward term for term, checked against it by hand and in
    test_rspo.py on hand-computed cases: r = r_type * (attribute + option matches + 1[price <= cap]) /
    (|attributes| + |options| + 1). The one substitution: r_type's title nouns come from the generator, not
    spaCy's tagger. token_set_ratio is fuzzywuzzy's on difflib (thefuzz's Levenshtein can differ by a point
    near 85); normalize_color is the identity. Success = reward 1.0, 15 steps; a random policy wins ~4 %,
    the expert every goal in 3-7 steps.
  progress: the formula for the product on screen with its chosen options, 0 on search and results pages,
    the purchase reward once bought.
  dense_reward: 0.2 x that formula on each arrival at an item page, 0.1 per click on a goal option, 1.0 x
    the purchase reward (dense_view_weight, dense_option_bonus, dense_buy_weight): revisits pay again, so
    it teaches to buy late or never.

Real benchmarks (backend="real"): RealALFWorldEnv wraps the TextWorld env as AlfredTWEnv does (game files from
game_files or $ALFWORLD_DATA/json_2.1.1/<split>; progress, dense_reward and the expert from its PDDL facts);
RealWebShopEnv wraps WebAgentTextEnv from a checkout at $WEBSHOP_ROOT. A missing one is a one-line error.
"""

import difflib
import functools
import glob
import itertools
import json
import math
import os
import random
import re
import reprlib
import sys
from dataclasses import dataclass, field, replace

# ---------------------------------------------------------------------------------------------
# 1. Vocabulary tables (ALFRED names, lower-cased as the text engine prints them)
# ---------------------------------------------------------------------------------------------

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)

# Goal sentence templates (alfworld.gen.goal_library), two per task type.
GOAL_TEMPLATES = {
    "pick_and_place_simple": ("put a {obj} in {recep}", "put some {obj} on {recep}"),
    "look_at_obj_in_light": ("look at {obj} under the {toggle}", "examine the {obj} with the {toggle}"),
    "pick_clean_then_place_in_recep": ("put a clean {obj} in {recep}",
                                       "clean some {obj} and put it in {recep}"),
    "pick_heat_then_place_in_recep": ("put a hot {obj} in {recep}", "heat some {obj} and put it in {recep}"),
    "pick_cool_then_place_in_recep": ("put a cool {obj} in {recep}", "cool some {obj} and put it in {recep}"),
    "pick_two_obj_and_place": ("put two {obj} in {recep}", "find two {obj} and put them in {recep}"),
}

# State-changing tasks: task type -> (verb, appliance receptacle type, required object property).
TREATMENTS = {
    "pick_clean_then_place_in_recep": ("clean", "sinkbasin", "cleanable"),
    "pick_heat_then_place_in_recep": ("heat", "microwave", "heatable"),
    "pick_cool_then_place_in_recep": ("cool", "fridge", "coolable"),
}

# Rooms: receptacle types and pickupable object types (ALFRED scenes; knives left out, see docstring).
ROOMS = {
    "kitchen": {
        "receptacles": "cabinet coffeemachine countertop diningtable drawer fridge garbagecan microwave "
                       "shelf sinkbasin stoveburner toaster".split(),
        "objects": "apple bowl bread cup dishsponge egg fork kettle ladle lettuce mug pan peppershaker "
                   "plate pot potato saltshaker soapbottle spatula spoon tomato winebottle".split(),
        "lamps": [],
    },
    "bathroom": {
        "receptacles": "bathtubbasin cabinet countertop drawer garbagecan handtowelholder shelf sinkbasin "
                       "toilet toiletpaperhanger towelholder".split(),
        "objects": "candle cloth dishsponge handtowel soapbar soapbottle spraybottle tissuebox "
                   "toiletpaper towel".split(),
        "lamps": [],
    },
    "bedroom": {
        "receptacles": "armchair bed desk drawer dresser garbagecan laundryhamper safe shelf "
                       "sidetable".split(),
        "objects": "alarmclock baseballbat basketball book cd cellphone cloth creditcard keychain laptop "
                   "mug pen pencil pillow tennisracket watch".split(),
        "lamps": ["desklamp"],
    },
    "livingroom": {
        "receptacles": "armchair cabinet coffeetable diningtable drawer garbagecan ottoman shelf sidetable "
                       "sofa tvstand".split(),
        "objects": "box book creditcard keychain laptop newspaper pillow remotecontrol statue tissuebox "
                   "vase watch wateringcan".split(),
        "lamps": ["desklamp", "floorlamp"],
    },
}
LAMPS = ("desklamp", "floorlamp")                   # toggleable, not pickupable
LAMP_STANDS = ("desk", "dresser", "sidetable")        # where a lamp stands

# Which rooms each task type uses (alfworld.gen.constants.GOALS_VALID).
TASK_ROOMS = {
    "pick_and_place_simple": ("kitchen", "livingroom", "bathroom", "bedroom"),
    "look_at_obj_in_light": ("livingroom", "bedroom"),
    "pick_clean_then_place_in_recep": ("kitchen", "bathroom"),
    "pick_heat_then_place_in_recep": ("kitchen",),
    "pick_cool_then_place_in_recep": ("kitchen",),
    "pick_two_obj_and_place": ("kitchen", "livingroom", "bathroom", "bedroom"),
}

OPENABLE = ("cabinet", "drawer", "fridge", "microwave", "safe")  # OPENABLE_CLASS_LIST, receptacles only

# Object properties besides `pickupable` (VAL_ACTION_OBJECTS; isReceptacleObject = MOVABLE_RECEPTACLES).
OBJECT_PROPS = {
    "apple": ("cleanable", "heatable", "coolable", "sliceable"),
    "bowl": ("cleanable", "coolable", "isReceptacleObject"),
    "box": ("isReceptacleObject",),
    "bread": ("heatable", "coolable", "sliceable"),
    "cloth": ("cleanable",),
    "cup": ("cleanable", "heatable", "coolable", "isReceptacleObject"),
    "dishsponge": ("cleanable",),
    "egg": ("cleanable", "heatable", "coolable", "sliceable"),
    "fork": ("cleanable",),
    "kettle": ("cleanable",),
    "ladle": ("cleanable",),
    "lettuce": ("cleanable", "coolable", "sliceable"),
    "mug": ("cleanable", "heatable", "coolable", "isReceptacleObject"),
    "pan": ("cleanable", "coolable", "isReceptacleObject"),
    "plate": ("cleanable", "heatable", "coolable", "isReceptacleObject"),
    "pot": ("cleanable", "coolable", "isReceptacleObject"),
    "potato": ("cleanable", "heatable", "coolable", "sliceable"),
    "soapbar": ("cleanable",),
    "spatula": ("cleanable",),
    "spoon": ("cleanable",),
    "tomato": ("cleanable", "heatable", "coolable", "sliceable"),
    "winebottle": ("coolable",),
    "desklamp": ("toggleable",),
    "floorlamp": ("toggleable",),
}

_ANY_SURFACE = (
    "alarmclock apple baseballbat basketball book bowl box bread candle cd cellphone cloth creditcard cup "
    "dishsponge egg fork handtowel kettle keychain ladle laptop lettuce mug newspaper pan pen pencil "
    "peppershaker plate pot potato remotecontrol saltshaker soapbar soapbottle spatula spoon spraybottle "
    "statue tennisracket tissuebox toiletpaper tomato vase watch wateringcan winebottle"
)
# Receptacle type -> object types it may hold (VAL_RECEPTACLE_OBJECTS, restricted to ROOMS' objects).
CAN_CONTAIN = {r: set(objs.split()) for r, objs in {
    "armchair": "basketball book box cellphone cloth creditcard keychain laptop newspaper pillow "
                "remotecontrol",
    "bathtubbasin": "cloth dishsponge handtowel soapbar",
    "bed": "baseballbat basketball book cellphone laptop newspaper pillow tennisracket",
    "cabinet": "book bowl box candle cd cloth cup dishsponge handtowel kettle ladle mug newspaper pan "
               "peppershaker plate pot saltshaker soapbar soapbottle spraybottle tissuebox toiletpaper "
               "vase wateringcan winebottle",
    "coffeemachine": "mug",
    "coffeetable": _ANY_SURFACE,
    "countertop": _ANY_SURFACE,
    "desk": "alarmclock basketball book bowl box candle cd cellphone cloth creditcard cup keychain laptop "
            "mug newspaper pen pencil plate remotecontrol soapbottle spraybottle statue tennisracket "
            "tissuebox toiletpaper vase watch wateringcan winebottle",
    "diningtable": _ANY_SURFACE,
    "drawer": "book candle cd cellphone cloth creditcard dishsponge fork handtowel keychain ladle newspaper "
              "pen pencil peppershaker remotecontrol saltshaker soapbar soapbottle spatula spoon "
              "spraybottle tissuebox toiletpaper watch wateringcan",
    "dresser": "alarmclock basketball book bowl box candle cd cellphone cloth creditcard cup keychain "
               "laptop mug newspaper pen pencil plate remotecontrol spraybottle statue tennisracket "
               "tissuebox toiletpaper vase watch wateringcan winebottle",
    "fridge": "apple bowl bread cup egg lettuce mug pan plate pot potato tomato winebottle",
    "garbagecan": "apple bread cd cloth dishsponge egg handtowel lettuce newspaper pen pencil potato soapbar "
                  "soapbottle spraybottle tissuebox toiletpaper tomato winebottle",
    "handtowelholder": "handtowel",
    "laundryhamper": "cloth",
    "microwave": "apple bowl bread cup egg mug plate potato tomato",
    "ottoman": "basketball book box cellphone cloth creditcard keychain laptop newspaper pillow "
               "remotecontrol",
    "safe": "cd cellphone creditcard keychain statue vase watch",
    "shelf": "alarmclock book bowl box candle cd cellphone cloth creditcard cup dishsponge handtowel kettle "
             "keychain mug newspaper pen pencil peppershaker plate pot remotecontrol saltshaker soapbar "
             "soapbottle spraybottle statue tissuebox toiletpaper vase watch wateringcan winebottle",
    "sidetable": _ANY_SURFACE,
    "sinkbasin": "apple bowl cloth cup dishsponge egg fork handtowel kettle ladle lettuce mug pan plate pot "
                 "potato soapbar spatula spoon tomato",
    "sofa": "basketball book box cellphone cloth creditcard keychain laptop newspaper pillow remotecontrol",
    "stoveburner": "kettle pan pot",
    "toaster": "",
    "toilet": "candle cloth dishsponge handtowel newspaper soapbar soapbottle spraybottle tissuebox "
              "toiletpaper",
    "toiletpaperhanger": "toiletpaper",
    "towelholder": "towel",
    "tvstand": "tissuebox",
}.items()}

# ALFRED's CamelCase type names, for writing PDDL (the engine prints them lower-cased).
ALFRED_TYPES = {name.lower(): name for name in (
    "AlarmClock Apple ArmChair BaseballBat BasketBall BathtubBasin Bed Book Bowl Box Bread ButterKnife "
    "Cabinet Candle CD CellPhone Cloth CoffeeMachine CoffeeTable CounterTop CreditCard Cup DeskLamp Desk "
    "DiningTable DishSponge Drawer Dresser Egg FloorLamp Fork Fridge GarbageCan HandTowel HandTowelHolder "
    "Kettle KeyChain Knife Ladle Laptop LaundryHamper Lettuce Microwave Mug Newspaper Ottoman Pan Pen "
    "Pencil PepperShaker Pillow Plate Pot Potato RemoteControl Safe SaltShaker Shelf SideTable SinkBasin "
    "SoapBar SoapBottle Sofa Spatula Spoon SprayBottle Statue StoveBurner TennisRacket TissueBox Toaster "
    "Toilet ToiletPaper ToiletPaperHanger Tomato Towel TowelHolder TVStand Vase Watch WateringCan "
    "WineBottle").split()}

# ---------------------------------------------------------------------------------------------
# 2. The engine's text (alfworld 0.4.2 `alfred.twl2`), one template per message
# ---------------------------------------------------------------------------------------------

MESSAGES = {
    "intro": "-= Welcome to TextWorld, ALFRED! =-\n\n"
             "You are in the middle of a room. Looking quickly around you, you see {things}.\n\n"
             "Your task is to: {goal}.",
    "look_middle": "You are in the middle of a room. Looking quickly around you, you see nothing.",
    "look_at": "You are facing the {r}. Next to it, you see nothing.",
    "arrive": "You arrive at {r}. {contents}",
    "open": "You open the {r}. {contents}",
    "close": "You close the {r}.",
    "take": "You pick up the {o} from the {r}.",
    "move": "You move the {o} to the {r}.",
    "put": "You put the {o} in/on the {r}.",               # grammar="put" (alfworld <= 0.3)
    "treat": "You {verb} the {o} using the {r}.",
    "use": "You turn on the {o}.",                         # ToggleObject always sets isToggled
    "closed": "The {r} is closed.",
    "open_contents": "The {r} is open. In it, you see {things}.",
    "on_contents": "On the {r}, you see {things}.",
    "carrying": "You are carrying: {things}.",
    "empty_handed": "You are not carrying anything.",
    "nothing_happens": "Nothing happens.",
    # examine O, first matching rule wins (the grammar's order; nothing is ever sliced here)
    "receptacle_object": "This is a normal {o}. In it, you see nothing.",
    "hot_clean": "This is a hot and clean {o}.",
    "cool_clean": "This is a cool and clean {o}.",
    "hot": "This is a hot {o}.",
    "clean": "This is a clean {o}.",
    "cool": "This is a cold {o}.",
    "plain": "There's nothing special about {o}.",
}

HELP_TEXT = (
    "Available commands:\n"
    "  look:                             look around your current location\n"
    "  inventory:                        check your current inventory\n"
    "  go to (receptacle):               move to a receptacle\n"
    "  open (receptacle):                open a receptacle\n"
    "  close (receptacle):               close a receptacle\n"
    "  take (object) from (receptacle):  take an object from a receptacle\n"
    "  move (object) to (receptacle):  place an object in or on a receptacle\n"
    "  examine (something):              examine a receptacle or an object\n"
    "  use (object):                     use an object\n"
    "  heat (object) with (receptacle):  heat an object using a receptacle\n"
    "  clean (object) with (receptacle): clean an object using a receptacle\n"
    "  cool (object) with (receptacle):  cool an object using a receptacle\n"
    "  slice (object) with (object):     slice an object using a sharp object\n"
)
# The older grammar's help line (not checkable against 0.4.2; wording from ReAct-era prompts).
HELP_TEXT_PUT = HELP_TEXT.replace(
    "  move (object) to (receptacle):  place an object in or on a receptacle\n",
    "  put (object) in/on (receptacle): place an object in or on a receptacle\n")

# Commands, as regular expressions over the stripped action string (names never contain the verbs).
COMMANDS = {
    "go": re.compile(r"go to (?P<r>.+)"),
    "open": re.compile(r"open (?P<r>.+)"),
    "close": re.compile(r"close (?P<r>.+)"),
    "take": re.compile(r"take (?P<o>.+) from (?P<r>.+)"),
    "move": re.compile(r"move (?P<o>.+) to (?P<r>.+)"),
    "put": re.compile(r"put (?P<o>.+) in/on (?P<r>.+)"),
    "treat": re.compile(r"(?P<verb>clean|heat|cool) (?P<o>.+) with (?P<r>.+)"),
    "use": re.compile(r"use (?P<o>.+)"),
    "examine": re.compile(r"examine (?P<x>.+)"),
    "look": re.compile(r"look"),
    "inventory": re.compile(r"inventory"),
    "help": re.compile(r"help"),
}

# Success of a uniformly random admissible-action policy at the default size, 1000 train episodes per
# task type (`python scripts/bench_envs.py --random-success`); 0.035 over all six types.
RANDOM_POLICY_SUCCESS = {
    "pick_and_place_simple": 0.065,
    "look_at_obj_in_light": 0.118,
    "pick_clean_then_place_in_recep": 0.008,
    "pick_heat_then_place_in_recep": 0.008,
    "pick_cool_then_place_in_recep": 0.009,
    "pick_two_obj_and_place": 0.001,
}

DEFAULTS = dict(max_steps=50, num_receptacles=6, num_distractors=2, grammar="move")
SPLIT_SIZES = {"train": 5000, "valid_seen": 140, "valid_unseen": 134}
DENSE_EVENT_REWARD = 0.2


# Option specs: option name -> (what a value must be, test of a value); `check_options` applies them.
def _number_spec(integer, low=None, high=None):
    """The spec of a numeric option: an integer (or any finite number) in [low, high]; bool is no number."""
    what = "an integer" if integer else "a number"
    if low is not None:
        what += f" >= {low}" if high is None else f" from {low} to {high}"

    def test(value):
        return (isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
                and math.isfinite(value) and (low is None or value >= low)
                and (high is None or value <= high))
    return what, test


def check_options(env, options, specs):
    """Raise a one-line ValueError naming the first of `options` that fails its spec in `specs`."""
    for name, value in options.items():
        what, test = specs[name]
        if not test(value):
            raise ValueError(f"{env} option {name}={reprlib.repr(value)}: expected {what}")


# pddl_id numbers instance k as 999 - k and the demangler numbers ids in string order, so k <= 899 keeps
# three digits (and the real engine's numbering equal to ours). generate_layout's required receptacles: the
# goal receptacle or a lamp stand, the appliance of clean/heat/cool tasks and a start.
MAX_INSTANCES = 899
MIN_RECEPTACLES = 3
_PATH = (str, os.PathLike)
ALFWORLD_OPTIONS = {
    "max_steps": _number_spec(True, 1),
    "num_receptacles": _number_spec(True, MIN_RECEPTACLES, MAX_INSTANCES),
    "num_distractors": _number_spec(True, 0, MAX_INSTANCES),
    "grammar": ("'move' or 'put'", lambda value: value in ("move", "put")),
    "task_types": (f"a non-empty list of {list(TASK_TYPES)}", lambda value: isinstance(value, (list, tuple))
                   and len(value) > 0 and all(t in TASK_TYPES for t in value)),
    "game_files": ("a folder or a list of .tw-pddl files", lambda value: isinstance(value, _PATH) or (
        isinstance(value, (list, tuple)) and all(isinstance(f, _PATH) for f in value))),
}
# The options each backend takes (the generator's sizes mean nothing to the real engine's game files).
ALFWORLD_BACKEND_OPTIONS = {
    "offline": ("max_steps", "task_types", "num_receptacles", "num_distractors", "grammar"),
    "real": ("max_steps", "game_files"),
}


# ---------------------------------------------------------------------------------------------
# 3. Names and lists
# ---------------------------------------------------------------------------------------------

def kind(name):
    """'cabinet 2' -> 'cabinet'."""
    return name.rsplit(" ", 1)[0]


def pddl_id(name):
    """The raw PDDL id whose demangled name is `name`, e.g. 'cabinet 2' -> 'cabinet_bar_997'.

    AlfredDemangler sorts the raw ids and gives the *highest* number to the id that sorts first, so
    instance k gets suffix 999 - k. Basins need ALFRED's 'Sink|...|SinkBasin' form ('sink' + 'basin').
    Sorting these ids is also how the engine orders every list it prints.
    """
    t, number = kind(name), int(name.rsplit(" ", 1)[1])
    if t.endswith("basin"):
        return f"{t[:-len('basin')]}_bar_{999 - number}_bar_{t}"
    return f"{t}_bar_{999 - number}"


def render_list(names):
    """'a apple 1, a egg 2, and a mug 1' in the engine's order; 'nothing' when empty."""
    items = [f"a {n}" for n in sorted(names, key=pddl_id)]
    if not items:
        return "nothing"
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + ", and " + items[-1]


# ---------------------------------------------------------------------------------------------
# 4. State, task and the engine's rules
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    type: str
    obj: str
    recep: str = None           # goal receptacle type (None for look tasks)
    toggle: str = None          # lamp type for look tasks
    text: str = ""


@dataclass
class House:
    """Everything the rules read: what is where, what is open, hot, clean, ... (one PDDL state)."""
    receptacles: list                               # names, e.g. ['cabinet 1', 'fridge 1']
    openable: set
    props: dict                                     # object name -> set of ALFRED props
    where: dict                                     # object name -> receptacle name (None while held)
    opened: set = field(default_factory=set)
    agent_at: str = None                            # receptacle name, None in the middle of the room
    holding: str = None
    clean: set = field(default_factory=set)
    hot: set = field(default_factory=set)
    cool: set = field(default_factory=set)
    toggled: set = field(default_factory=set)

    def treated(self, verb):
        """The objects a treatment has marked: 'clean' -> clean, 'heat' -> hot, 'cool' -> cool."""
        return {"clean": self.clean, "heat": self.hot, "cool": self.cool}[verb]

    def inside(self, r):
        return [o for o, at in self.where.items() if at == r]

    def accessible(self, r):
        return r not in self.openable or r in self.opened


def can_contain(recep, obj):
    return kind(obj) in CAN_CONTAIN.get(kind(recep), ())


def move_command(o, r, grammar):
    return f"put {o} in/on {r}" if grammar == "put" else f"move {o} to {r}"


def admissible_commands(h, grammar="move"):
    """The engine's admissible commands (sorted, unique) for state `h`."""
    cmds = {"help", "inventory", "look"} | {f"go to {r}" for r in h.receptacles if r != h.agent_at}
    if h.holding:
        cmds.add(f"examine {h.holding}")
    r = h.agent_at
    if r is not None:
        cmds.add(f"examine {r}")
        if r in h.openable:
            cmds.add(f"close {r}" if r in h.opened else f"open {r}")
        for o in h.inside(r):
            if "toggleable" in h.props[o]:
                cmds.add(f"use {o}")
            if h.holding is None and h.accessible(r) and "pickupable" in h.props[o]:
                cmds.add(f"take {o} from {r}")
        o = h.holding
        if o is not None:
            if h.accessible(r) and can_contain(r, o):
                cmds.add(move_command(o, r, grammar))
            for verb, appliance, prop in TREATMENTS.values():
                if kind(r) == appliance and prop in h.props[o]:
                    cmds.add(f"{verb} {o} with {r}")
    return sorted(cmds)


def parse_command(action):
    """'take apple 1 from countertop 1' -> ('take', {'o': 'apple 1', 'r': 'countertop 1'})."""
    for verb, pattern in COMMANDS.items():
        m = pattern.fullmatch(action)
        if m:
            return verb, m.groupdict()
    return None, {}


def describe_receptacle(h, r):
    """The receptacle part of the arrival text (also `examine R`)."""
    if r in h.openable:
        if r in h.opened:
            return MESSAGES["open_contents"].format(r=r, things=render_list(h.inside(r)))
        return MESSAGES["closed"].format(r=r)
    return MESSAGES["on_contents"].format(r=r, things=render_list(h.inside(r)))


def describe_object(h, o):
    """`examine O` for the held object (note 'cold' for cool objects, as in the grammar)."""
    if "isReceptacleObject" in h.props[o]:
        key = "receptacle_object"
    elif o in h.clean and o in h.hot:
        key = "hot_clean"
    elif o in h.clean and o in h.cool:
        key = "cool_clean"
    else:
        key = next((k for k, s in (("hot", h.hot), ("clean", h.clean), ("cool", h.cool)) if o in s), "plain")
    return MESSAGES[key].format(o=o)


def apply_command(h, action, grammar="move"):
    """Execute an admissible `action` on `h` in place; return the observation text."""
    verb, a = parse_command(action)
    if verb == "go":
        h.agent_at = a["r"]
        return MESSAGES["arrive"].format(r=a["r"], contents=describe_receptacle(h, a["r"]))
    if verb == "open":
        h.opened.add(a["r"])
        return MESSAGES["open"].format(r=a["r"], contents=describe_receptacle(h, a["r"]))
    if verb == "close":
        h.opened.discard(a["r"])
        return MESSAGES["close"].format(r=a["r"])
    if verb == "take":
        h.holding, h.where[a["o"]] = a["o"], None
        return MESSAGES["take"].format(o=a["o"], r=a["r"])
    if verb in ("move", "put"):
        h.holding, h.where[a["o"]] = None, a["r"]
        return MESSAGES[verb].format(o=a["o"], r=a["r"])
    if verb == "treat":
        o, v = a["o"], a["verb"]
        h.treated(v).add(o)
        if v in ("heat", "cool"):                     # heating uncools and cooling unheats
            (h.cool if v == "heat" else h.hot).discard(o)
        return MESSAGES["treat"].format(verb=v, o=o, r=a["r"])
    if verb == "use":
        h.toggled.add(a["o"])
        return MESSAGES["use"].format(o=a["o"])
    if verb == "examine":
        x = a["x"]
        return describe_receptacle(h, x) if x in h.receptacles else describe_object(h, x)
    if verb == "look":
        if h.agent_at is None:
            return MESSAGES["look_middle"]
        return MESSAGES["look_at"].format(r=h.agent_at)
    if verb == "inventory":
        if h.holding is None:
            return MESSAGES["empty_handed"]
        return MESSAGES["carrying"].format(things=render_list([h.holding]))
    if verb == "help":
        return HELP_TEXT_PUT if grammar == "put" else HELP_TEXT
    raise ValueError(f"not an engine command: {action!r}")


# ---------------------------------------------------------------------------------------------
# 5. Goals, progress, dense reward (shared by the offline env and the real adapter)
# ---------------------------------------------------------------------------------------------

def _treated(h, o, task):
    if task.type not in TREATMENTS:
        return True
    verb, _, prop = TREATMENTS[task.type]
    return prop in h.props[o] and o in h.treated(verb)


def _targets(h, task):
    return sorted(o for o in h.props if kind(o) == task.obj)


def _finished_in(h, r, task):
    """Target objects in receptacle r that need nothing more (treated, if the task asks)."""
    return [o for o in _targets(h, task) if h.where.get(o) == r and _treated(h, o, task)]


def _goal_receptacle(h, task):
    """The goal-type receptacle to fill: the one with most finished targets, then the first by name.

    All objects of pick_two must end in the *same* receptacle (the PDDL goal quantifies one ?r). The
    tie-break must not depend on where the agent stands, or the expert would walk back and forth.
    """
    receptacles = [r for r in h.receptacles if kind(r) == task.recep]
    return min(receptacles, key=lambda r: (-len(_finished_in(h, r, task)), pddl_id(r)))


def _placed(h, o, task):
    """Object o is finished and in the goal receptacle."""
    return o in _finished_in(h, _goal_receptacle(h, task), task)


def _lamps(h, task):
    return sorted(o for o in h.props if kind(o) == task.toggle and "toggleable" in h.props[o])


def _look_stages(h, task):
    """(holds the object, a lamp is on, holds it at a lamp, holds it at a lamp that is on)."""
    holds = h.holding is not None and kind(h.holding) == task.obj
    lamps = _lamps(h, task)
    here = [l for l in lamps if h.agent_at is not None and h.where.get(l) == h.agent_at]
    return (holds, any(l in h.toggled for l in lamps), holds and bool(here),
            holds and any(l in h.toggled for l in here))


def goal_satisfied(h, task):
    """The PDDL goal of `task` (alfworld.gen.goal_library) evaluated on `h`."""
    if task.type == "look_at_obj_in_light":
        return _look_stages(h, task)[-1]
    needed = 2 if task.type == "pick_two_obj_and_place" else 1
    return len(_finished_in(h, _goal_receptacle(h, task), task)) >= needed


def progress(h, task):
    """Aligned, state-based task progress in [0, 1]; 1.0 exactly when the goal holds."""
    if task.type == "look_at_obj_in_light":
        return sum(_look_stages(h, task)) / 4.0

    treat = task.type in TREATMENTS
    stages = 3 + treat
    goal = _goal_receptacle(h, task)

    def score(o):
        if _placed(h, o, task):
            return stages
        held = h.holding == o
        return held + (treat and _treated(h, o, task)) + (held and h.agent_at == goal)

    needed = 2 if task.type == "pick_two_obj_and_place" else 1
    best = sorted((score(o) for o in _targets(h, task)), reverse=True)[:needed]
    return sum(best) / (needed * stages)


def dense_reward(action, after, task):
    """Process reward of one executed admissible `action` that led to state `after`.

    Event-based and re-earnable on purpose (see the module docstring): +DENSE_EVENT_REWARD when the
    action takes a target-type object, gives a target the task's treatment, arrives at a goal receptacle
    (or the lamp's receptacle) holding a target, moves a target into a goal receptacle, or turns on the
    task's lamp while holding a target; 0 otherwise.
    """
    verb, a = parse_command(action)
    holds_target = after.holding is not None and kind(after.holding) == task.obj
    lamp_stands = {after.where.get(l) for l in _lamps(after, task)} if task.toggle else set()
    treatment = TREATMENTS.get(task.type, (None,))[0]
    event = (
        (verb == "take" and kind(a["o"]) == task.obj)
        or (verb == "treat" and a["verb"] == treatment and kind(a["o"]) == task.obj)
        or (verb == "go" and holds_target and (kind(a["r"]) == task.recep or a["r"] in lamp_stands))
        or (verb in ("move", "put") and kind(a["o"]) == task.obj and kind(a["r"]) == task.recep)
        or (verb == "use" and holds_target and kind(a["o"]) == task.toggle)
    )
    return DENSE_EVENT_REWARD if event else 0.0


# ---------------------------------------------------------------------------------------------
# 6. Scripted expert: replans from the current state, so it recovers from any detour
# ---------------------------------------------------------------------------------------------

def _approach(h, r):
    """First step towards standing at an accessible `r`, or None when already there and open."""
    if h.agent_at != r:
        return f"go to {r}"
    if not h.accessible(r):
        return f"open {r}"
    return None


def _nearest(h, receptacles):
    """Prefer the receptacle the agent stands at, then the first by name."""
    return min(receptacles, key=lambda r: (r != h.agent_at, pddl_id(r)))


def _put_down(h, grammar):
    """Put the held object back somewhere it fits (here if possible)."""
    o = h.holding
    r = _nearest(h, [r for r in h.receptacles if can_contain(r, o)])
    return _approach(h, r) or move_command(o, r, grammar)


def _fetch(h, candidates):
    """Walk to the nearest candidate object, open its receptacle, take it."""
    o = min(candidates, key=lambda o: (h.where[o] != h.agent_at, pddl_id(o)))
    r = h.where[o]
    return _approach(h, r) or f"take {o} from {r}"


def expert_action(h, task, grammar="move"):
    """The scripted expert's next command from state `h` ('look' once the goal holds)."""
    if goal_satisfied(h, task):
        return "look"
    held = h.holding
    if task.type == "look_at_obj_in_light":
        if held is None:
            return _fetch(h, _targets(h, task))
        if kind(held) != task.obj:
            return _put_down(h, grammar)
        lamp = _lamps(h, task)[0]
        return _approach(h, h.where[lamp]) or f"use {lamp}"

    if held is not None and kind(held) == task.obj:
        if not _treated(h, held, task):
            verb, appliance, _ = TREATMENTS[task.type]
            r = _nearest(h, [r for r in h.receptacles if kind(r) == appliance])
            return f"go to {r}" if h.agent_at != r else f"{verb} {held} with {r}"
        r = _goal_receptacle(h, task)
        return _approach(h, r) or move_command(held, r, grammar)
    if held is not None:
        return _put_down(h, grammar)
    return _fetch(h, [o for o in _targets(h, task) if not _placed(h, o, task)])


def _must_search(h, task):
    """Does the expert's next move need an object `h` does not show: a target to fetch, or a lamp?"""
    held = h.holding
    if task.type == "look_at_obj_in_light":
        if held is None:
            return not _targets(h, task)
        return kind(held) == task.obj and not _lamps(h, task)
    return held is None and not [o for o in _targets(h, task) if not _placed(h, o, task)]


def searching_action(h, task, searched, grammar="move"):
    """The expert without its privilege, a demonstrator for imitation: it plans on what the agent has seen,
    the objects it holds or saw in the receptacles it has looked into (`searched`), and while the object it
    needs is not among them it looks into the next unsearched receptacle in the intro's order (go to, open)."""
    seen = {o for o, r in h.where.items() if r is None or r in searched}
    known = replace(h, props={o: p for o, p in h.props.items() if o in seen},
                    where={o: r for o, r in h.where.items() if o in seen})
    if _must_search(known, task):
        return _approach(h, min((r for r in h.receptacles if r not in searched), key=pddl_id))
    return expert_action(known, task, grammar)


# ---------------------------------------------------------------------------------------------
# 7. Procedural households and the fixed task lists
# ---------------------------------------------------------------------------------------------

def _starts(room, obj, target):
    """Receptacle types of `room` where `obj` may start (never inside the goal receptacle type)."""
    return [r for r in ROOMS[room]["receptacles"] if r != target and obj in CAN_CONTAIN[r]]


def _fits(task_type, room, obj, target):
    """Can `room` host this task: object, target (goal receptacle or lamp), appliance and a start?"""
    spec = ROOMS[room]
    if obj not in spec["objects"] or not _starts(room, obj, target):
        return False
    if task_type == "look_at_obj_in_light":
        return target in spec["lamps"] and any(s in spec["receptacles"] for s in LAMP_STANDS)
    if task_type in TREATMENTS:
        _, appliance, prop = TREATMENTS[task_type]
        if (prop not in OBJECT_PROPS.get(obj, ()) or appliance not in spec["receptacles"]
                or target == appliance):
            return False
    return target in spec["receptacles"] and obj in CAN_CONTAIN[target]


@functools.lru_cache(maxsize=None)
def _task_combos(task_type):
    """Every valid (object type, goal receptacle or lamp type) pair for `task_type`, sorted. Cached: a fixed
    table, and recomputing it for every make_env was ~1.5% of a tiny-model run. A tuple, so no caller edits it."""
    return tuple(sorted({(obj, target) for room in TASK_ROOMS[task_type] for obj in ROOMS[room]["objects"]
                         for target in ROOMS[room]["receptacles"] + ROOMS[room]["lamps"]
                         if _fits(task_type, room, obj, target)}))


def split_combos(split, task_type):
    """valid_unseen holds out every fifth combination (index % 5 == 2); the other splits use the rest."""
    combos = _task_combos(task_type)
    unseen = split == "valid_unseen"
    return [c for i, c in enumerate(combos) if (i % 5 == 2) == unseen]


def _check_split(split):
    if split not in SPLIT_SIZES:
        raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {sorted(SPLIT_SIZES)}")


def generate_layout(split="train", index=0, task_types=TASK_TYPES, num_receptacles=6, num_distractors=2):
    """The layout dict of task `index` of `split` (see ALFWorldEnv.from_layout for the format).

    Receptacles: the goal receptacle (or a lamp stand), the appliance of clean/heat/cool tasks and one
    place the target can start, then random receptacles of the room up to `num_receptacles`. Objects:
    one target (two for pick_two) away from the goal receptacles, `num_distractors` other objects of the
    room wherever they fit, and the lamp of a look task.
    """
    _check_split(split)
    rng = random.Random(f"alfworld/{split}/{index}")
    task_type = task_types[index % len(task_types)]
    obj, target = rng.choice(split_combos(split, task_type))
    room = rng.choice([room for room in TASK_ROOMS[task_type] if _fits(task_type, room, obj, target)])
    spec = ROOMS[room]
    look = task_type == "look_at_obj_in_light"

    required = [rng.choice([s for s in LAMP_STANDS if s in spec["receptacles"]]) if look else target]
    if task_type in TREATMENTS:
        required.append(TREATMENTS[task_type][1])
    required.append(rng.choice(_starts(room, obj, target)))
    kinds = required + rng.choices(spec["receptacles"], k=max(0, num_receptacles - len(required)))
    names = _number(kinds)
    receptacles = [{"name": n, "openable": kind(n) in OPENABLE, "opened": False} for n in names]

    starts = [i for i, t in enumerate(kinds) if t in _starts(room, obj, target)]
    n_targets = 2 if task_type == "pick_two_obj_and_place" else 1
    placed = [(obj, rng.choice(starts)) for _ in range(n_targets)]
    distractors = [(o, i) for o in spec["objects"] if o != obj
                   for i, t in enumerate(kinds) if o in CAN_CONTAIN[t]]
    placed += [rng.choice(distractors) for _ in range(num_distractors if distractors else 0)]
    if look:
        placed.append((target, 0))                      # the lamp stands on required[0]
    objects = [{"name": n, "in": names[i],
                "props": ([] if kind(n) in LAMPS else ["pickupable"]) + list(OBJECT_PROPS.get(kind(n), ()))}
               for n, (_, i) in zip(_number([o for o, _ in placed]), placed)]

    text = rng.choice(GOAL_TEMPLATES[task_type]).format(obj=obj, recep=target, toggle=target)
    task = {"type": task_type, "obj": obj, "recep": None if look else target,
            "toggle": target if look else None, "text": text}
    return {"task": task, "receptacles": receptacles, "objects": objects}


def _number(kinds):
    """['cabinet', 'fridge', 'cabinet'] -> ['cabinet 1', 'fridge 1', 'cabinet 2']."""
    seen = {}
    names = []
    for t in kinds:
        seen[t] = seen.get(t, 0) + 1
        names.append(f"{t} {seen[t]}")
    return names


# ---------------------------------------------------------------------------------------------
# 8. The offline environment
# ---------------------------------------------------------------------------------------------

def check_layout(layout):
    """Raise a one-line ValueError naming the first problem of a layout (format: ALFWorldEnv): a missing
    key, an unknown task type, a name that is not '<known type> <number>' or used twice, an object in a
    receptacle the layout lacks, or fewer target objects, goal receptacles, lamps or appliances than the
    task needs."""
    def need(ok, problem):
        if not ok:
            raise ValueError(f"bad ALFWorld layout: {problem}")

    def name_of(entry, keys, types, what):
        need(isinstance(entry, dict) and all(k in entry for k in keys),
             f"every {what} needs keys {list(keys)}")
        name = entry["name"]
        need(isinstance(name, str) and re.fullmatch(r"[a-z]+ [1-9][0-9]*", name) and kind(name) in types,
             f"{what} name {name!r} is not '<known {what} type> <number>'")
        return name

    need(isinstance(layout, dict) and all(k in layout for k in ("task", "receptacles", "objects")),
         "expected a dict with keys 'task', 'receptacles' and 'objects'")
    task = layout["task"]
    need(isinstance(task, dict), "'task' must be a dict")
    need(task.get("type") in TASK_TYPES, f"task type {task.get('type')!r} is not one of {list(TASK_TYPES)}")
    look = task["type"] == "look_at_obj_in_light"
    for key in ("obj", "toggle" if look else "recep", "text"):
        need(task.get(key), f"the task lacks {key!r}")
    receptacles = [name_of(r, ("name", "openable"), CAN_CONTAIN, "receptacle") for r in layout["receptacles"]]
    objects = [name_of(o, ("name", "in", "props"), set(ALFRED_TYPES) - set(CAN_CONTAIN), "object")
               for o in layout["objects"]]
    names = receptacles + objects
    need(len(set(names)) == len(names),
         f"names used twice: {sorted({n for n in names if names.count(n) > 1})}")
    for o in layout["objects"]:
        need(o["in"] in receptacles, f"object {o['name']!r} is in {o['in']!r}, which the layout lacks")
    needed = {task["obj"]: 2 if task["type"] == "pick_two_obj_and_place" else 1,
              task["toggle"] if look else task["recep"]: 1}
    if task["type"] in TREATMENTS:
        needed[TREATMENTS[task["type"]][1]] = 1
    for t, n in needed.items():
        have = sum(kind(x) == t for x in names)
        need(have >= n, f"the {task['type']} task needs {n} {t} but the layout has {have}")


class ALFWorldEnv:
    """Offline ALFWorld text game for one layout; same text and rules as the real engine.

    Layout format (also what `generate_layout` returns and `write_game_file` accepts):
        {"task": {"type": "pick_clean_then_place_in_recep", "obj": "apple", "recep": "fridge",
                  "toggle": None, "text": "put a clean apple in fridge"},
         "receptacles": [{"name": "cabinet 1", "openable": True, "opened": False}, ...],
         "objects": [{"name": "apple 1", "in": "countertop 1", "props": ["pickupable", "cleanable", ...]}]}
    Instances of a type are numbered 1..n. Every receptacle stands at its own location; the agent
    starts in the middle of the room. `check_layout` rejects a malformed layout.
    """

    def __init__(self, layout, max_steps=50, grammar="move"):
        check_options("ALFWorld", dict(max_steps=max_steps, grammar=grammar), ALFWORLD_OPTIONS)
        check_layout(layout)
        self.layout, self.max_steps, self.grammar = layout, max_steps, grammar
        t = layout["task"]
        self.task = Task(t["type"], t["obj"], t.get("recep"), t.get("toggle"), t["text"])
        self.reset()

    @classmethod
    def from_layout(cls, layout, max_steps=50, grammar="move"):
        return cls(layout, max_steps=max_steps, grammar=grammar)

    def _initial_house(self):
        rs, objs = self.layout["receptacles"], self.layout["objects"]
        return House(receptacles=[r["name"] for r in rs],
                     openable={r["name"] for r in rs if r["openable"]},
                     opened={r["name"] for r in rs if r["openable"] and r.get("opened")},
                     props={o["name"]: set(o["props"]) for o in objs},
                     where={o["name"]: o["in"] for o in objs})

    def reset(self):
        self.house = self._initial_house()
        self.steps, self.done, self.won = 0, False, False
        self.searched = set()   # receptacles whose contents the agent has seen (the searching expert's memory)
        self.last_obs = MESSAGES["intro"].format(things=render_list(self.house.receptacles),
                                                 goal=self.task.text)
        self.last_info = self._info(dense=0.0)
        return self.last_obs, dict(self.last_info)

    def _info(self, dense):
        return {"admissible_actions": admissible_commands(self.house, self.grammar), "won": self.won,
                "score": float(self.won), "task": self.task.text, "task_type": self.task.type,
                "progress": progress(self.house, self.task), "dense_reward": dense}

    def step(self, action):
        if self.done:
            return self.last_obs, 0.0, True, {**self.last_info, "dense_reward": 0.0}
        action = str(action).strip()
        self.steps += 1
        dense = 0.0
        if action in self.last_info["admissible_actions"]:
            obs = apply_command(self.house, action, self.grammar)
            dense = dense_reward(action, self.house, self.task)
            if self.house.agent_at is not None and self.house.accessible(self.house.agent_at):
                self.searched.add(self.house.agent_at)   # arriving at an open one, or opening it, shows its contents
        else:
            obs = MESSAGES["nothing_happens"]
        self.won = goal_satisfied(self.house, self.task)
        self.done = self.won or self.steps >= self.max_steps
        self.last_obs, self.last_info = obs, self._info(dense)
        return obs, float(self.won), self.done, dict(self.last_info)

    def expert_action(self):
        return expert_action(self.house, self.task, self.grammar)

    def searching_action(self):
        return searching_action(self.house, self.task, self.searched, self.grammar)


# ---------------------------------------------------------------------------------------------
# 9. Game files for the real engine (.tw-pddl JSON)
# ---------------------------------------------------------------------------------------------

# PDDL goals (alfworld.gen.goal_library.gdict[...]['pddl'], '#' written as '-').
_PLACE_GOAL = """(:goal (exists (?r - receptacle) (exists (?o - object) (and {extra}
    (objectType ?o {obj}Type) (receptacleType ?r {recep}Type) (inReceptacle ?o ?r)))))"""
GOAL_PDDL = {
    "pick_and_place_simple": _PLACE_GOAL.replace("{extra}", ""),
    "pick_clean_then_place_in_recep": _PLACE_GOAL.replace("{extra}", "(cleanable ?o) (isClean ?o)"),
    "pick_heat_then_place_in_recep": _PLACE_GOAL.replace("{extra}", "(heatable ?o) (isHot ?o)"),
    "pick_cool_then_place_in_recep": _PLACE_GOAL.replace("{extra}", "(coolable ?o) (isCool ?o)"),
    "pick_two_obj_and_place": """(:goal (exists (?r - receptacle) (exists (?o1 - object) (and
    (objectType ?o1 {obj}Type) (receptacleType ?r {recep}Type) (inReceptacle ?o1 ?r)
    (exists (?o2 - object) (and (not (= ?o1 ?o2)) (objectType ?o2 {obj}Type)
        (receptacleType ?r {recep}Type) (inReceptacle ?o2 ?r)))))))""",
    "look_at_obj_in_light": """(:goal (and
    (exists (?ot - object ?r - receptacle ?a - agent ?l - location) (and
        (objectType ?ot {toggle}Type) (toggleable ?ot) (isToggled ?ot)
        (receptacleAtLocation ?r ?l) (atLocation ?a ?l) (inReceptacle ?ot ?r)))
    (exists (?o - object ?a - agent) (and (objectType ?o {obj}Type) (holds ?a ?o)))))""",
}


def game_problem_pddl(layout):
    """The PDDL problem of a layout: each receptacle at its own location, the agent at loc 0."""
    def camel(t):
        return ALFRED_TYPES[t]

    rs, objs, task = layout["receptacles"], layout["objects"], layout["task"]
    # Declare every type constant the domain names (SinkBasinType, MicrowaveType, FridgeType, KnifeType).
    rtypes = sorted({kind(r["name"]) for r in rs} | {"sinkbasin", "microwave", "fridge"})
    otypes = sorted(set(ALFRED_TYPES) - set(CAN_CONTAIN))
    declare = ["agent1 - agent", "loc_bar_0 - location"]
    declare += [f"{camel(t)}Type - otype" for t in otypes]
    declare += [f"{camel(t)}Type - rtype" for t in rtypes]
    init = ["(atLocation agent1 loc_bar_0)"]
    location = {}
    for i, r in enumerate(rs, start=1):
        rid, location[r["name"]] = pddl_id(r["name"]), f"loc_bar_{i}"
        declare += [f"{rid} - receptacle", f"loc_bar_{i} - location"]
        init += [f"(receptacleType {rid} {camel(kind(r['name']))}Type)",
                 f"(receptacleAtLocation {rid} loc_bar_{i})"]
        if r["openable"]:
            init += [f"(openable {rid})"] + ([f"(opened {rid})"] if r.get("opened") else [])
    for o in objs:
        oid = pddl_id(o["name"])
        declare.append(f"{oid} - object")
        init += [f"(objectType {oid} {camel(kind(o['name']))}Type)",
                 f"(inReceptacle {oid} {pddl_id(o['in'])})",
                 f"(objectAtLocation {oid} {location[o['in']]})"]
        init += [f"({p} {oid})" for p in o["props"]]
    present = {kind(o["name"]) for o in objs}
    init += [f"(canContain {camel(r)}Type {camel(o)}Type)" for r in rtypes for o in sorted(present)
             if o in CAN_CONTAIN.get(r, ())]
    slots = {slot: camel(task[slot]) for slot in ("obj", "recep", "toggle") if task.get(slot)}
    goal = GOAL_PDDL[task["type"]].format(**slots)
    return ("(define (problem rspo_offline_layout)\n  (:domain alfred)\n  (:objects\n    "
            + "\n    ".join(declare) + "\n  )\n  (:init\n    " + "\n    ".join(init) + "\n  )\n  "
            + goal + "\n)\n")


def write_game_file(layout, path):
    """Write `layout` as an ALFWorld game file (.tw-pddl JSON) the real engine can play; returns path."""
    domain, grammar = _alfworld_data_files()
    game = {"pddl_domain": domain, "grammar": grammar.replace("UNKNOWN GOAL", layout["task"]["text"]),
            "pddl_problem": game_problem_pddl(layout), "solvable": True}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(game, f)
    return path


def _require_alfworld():
    try:
        import alfworld  # noqa: F401
        import textworld  # noqa: F401
    except ImportError as e:
        raise ImportError("the real ALFWorld backend needs the alfworld text engine: "
                          "pip install alfworld==0.4.2") from e


def _alfworld_data_files():
    """(alfred.pddl, alfred.twl2) shipped in the alfworld wheel."""
    _require_alfworld()
    import alfworld
    data = os.path.join(os.path.dirname(alfworld.__file__), "data")
    with open(os.path.join(data, "alfred.pddl")) as f, open(os.path.join(data, "alfred.twl2")) as g:
        return f.read(), g.read()


# ---------------------------------------------------------------------------------------------
# 10. Adapter to the real engine (textworld + alfworld 0.4.2)
# ---------------------------------------------------------------------------------------------

_PROP_FACTS = {p.lower(): p for p in ("pickupable", "cleanable", "heatable", "coolable", "toggleable",
                                       "sliceable", "isReceptacleObject")}


def house_from_facts(facts):
    """Rebuild the House of a real-engine state from its PDDL facts (`EnvInfos(facts=True)`)."""
    args = {}
    for fact in facts:
        args.setdefault(fact.name, []).append([v.name.strip() for v in fact.arguments])
    receptacles = sorted((a[0] for a in args.get("receptacletype", [])), key=pddl_id)
    objects = [a[0] for a in args.get("objecttype", [])]
    props = {o: set() for o in objects}
    for name, prop in _PROP_FACTS.items():
        for (o,) in args.get(name, []):
            props[o].add(prop)
    at_location = {loc: r for r, loc in args.get("receptacleatlocation", [])}
    agent_loc = next((loc for _, loc in args.get("atlocation", [])), None)
    holding = next((o for _, o in args.get("holds", [])), None)
    where = {o: None for o in objects}
    where.update({o: r for o, r in args.get("inreceptacle", [])})
    def unary(name):
        return {a[0] for a in args.get(name, [])}

    return House(receptacles=receptacles, openable=unary("openable"), opened=unary("opened"), props=props,
                 where=where, agent_at=at_location.get(agent_loc), holding=holding, clean=unary("isclean"),
                 hot=unary("ishot"), cool=unary("iscool"), toggled=unary("istoggled"))


def parse_goal(text):
    """'put a clean apple in fridge' -> Task (None if it is not one of the templates)."""
    for task_type, templates in GOAL_TEMPLATES.items():
        for template in templates:
            pattern = re.escape(template)
            for slot in ("obj", "recep", "toggle"):
                pattern = pattern.replace(re.escape("{" + slot + "}"), rf"(?P<{slot}>\w+)")
            m = re.fullmatch(pattern, text)
            if m:
                return Task(task_type, text=text, **m.groupdict())
    return None


def task_from_game_path(path, text=""):
    """ALFWorld's folder names say the task: '.../pick_heat_then_place_in_recep-Egg-None-Fridge-13/...'."""
    for part in reversed(os.path.normpath(path).split(os.sep)):
        bits = part.split("-")
        if bits[0] in TASK_TYPES and len(bits) >= 4:
            obj, target = bits[1].lower(), bits[3].lower()
            if bits[0] == "look_at_obj_in_light":
                return Task(bits[0], obj, toggle=target, text=text)
            return Task(bits[0], obj, recep=target, text=text)
    raise ValueError(f"cannot tell the task of {path!r} from its goal sentence or folder name")


_REGISTERED = {}        # (game file, max_steps) -> textworld env id


def _find_game_files(game_files, split):
    if game_files is None:
        root = os.environ.get("ALFWORLD_DATA")
        if not root:
            raise ValueError("backend='real' needs game_files=[...] or a folder, or $ALFWORLD_DATA "
                             "(see `alfworld-download`)")
        game_files = os.path.join(os.path.expandvars(root), "json_2.1.1", split)
    if isinstance(game_files, (str, os.PathLike)):
        folder = str(game_files)
        game_files = sorted(glob.glob(os.path.join(folder, "**", "*.tw-pddl"), recursive=True))
        if not game_files:
            raise ValueError(f"no .tw-pddl game files under {folder!r}")
    return list(game_files)


class RealALFWorldEnv:
    """The real ALFWorld text engine behind the same interface as ALFWorldEnv.

    Wraps `textworld.gym` with `AlfredDemangler(shuffle=False)` and `AlfredInfos` as AlfredTWEnv does.
    `progress`, `dense_reward` and `expert_action` come from the same functions as offline, applied to
    the state rebuilt from the engine's PDDL facts.
    """

    def __init__(self, game_files=None, split="train", seed=0, max_steps=50):
        files = _find_game_files(game_files, split)   # missing data first: the likelier mistake
        _require_alfworld()
        import textworld
        import textworld.gym
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos

        self.game_file, self.max_steps = files[seed % len(files)], max_steps
        key = (os.path.abspath(self.game_file), max_steps)
        if key not in _REGISTERED:
            infos = textworld.EnvInfos(admissible_commands=True, won=True, facts=True)
            _REGISTERED[key] = textworld.gym.register_game(
                self.game_file, infos, max_episode_steps=max_steps,
                wrappers=[AlfredDemangler(shuffle=False), AlfredInfos])
        self._env = textworld.gym.make(_REGISTERED[key])

    def reset(self):
        obs, infos = self._env.reset()
        goal = re.search(r"Your task is to: (.*)\.$", obs)
        text = goal.group(1) if goal else ""
        self.task = parse_goal(text) or task_from_game_path(self.game_file, text)
        self.steps, self.done, self.won = 0, False, False
        self._observe(infos)
        self.last_obs, self.last_info = obs, self._info(0.0)
        return obs, dict(self.last_info)

    def _observe(self, infos):
        self.house = house_from_facts(infos["facts"])
        self.admissible = sorted(set(infos["admissible_commands"]))

    def _info(self, dense):
        return {"admissible_actions": list(self.admissible), "won": self.won, "score": float(self.won),
                "task": self.task.text, "task_type": self.task.type,
                "progress": progress(self.house, self.task), "dense_reward": dense}

    def step(self, action):
        if self.done:
            return self.last_obs, 0.0, True, {**self.last_info, "dense_reward": 0.0}
        action = str(action)
        admissible_before = self.admissible
        obs, _, done, infos = self._env.step(action)
        self.steps += 1
        self._observe(infos)
        executed = action.strip() in admissible_before
        dense = dense_reward(action.strip(), self.house, self.task) if executed else 0.0
        self.won = bool(infos["won"])
        self.done = bool(done) or self.won or self.steps >= self.max_steps
        self.last_obs, self.last_info = obs, self._info(dense)
        return obs, float(self.won), self.done, dict(self.last_info)

    def expert_action(self):
        return expert_action(self.house, self.task)

    def close(self):
        self._env.close()


# ---------------------------------------------------------------------------------------------
# 11. WebShop offline. Constants of the real site
# ---------------------------------------------------------------------------------------------
SEP = " [SEP] "
SEARCH_RETURN_N = 50           # engine.py: at most 50 results per query
PRODUCT_WINDOW = 10            # engine.py: 10 results per page
PRICE_RANGE = [10.0 * i for i in range(1, 100)]   # goal.py: candidate price caps
EXACT_MATCH_OPTS = ["size"]    # goal.py: option groups matched exactly, not fuzzily
FUZZY_THRESHOLD = 85           # goal.py: `score > 85`
BACK_TO_SEARCH = "back to search"
PREV_PAGE = "< prev"
NEXT_PAGE = "next >"
BUY_NOW = "buy now"
SUB_PAGES = ("description", "features", "reviews")
WEBSHOP_SPLITS = {"test": (0, 500), "dev": (500, 1500), "train": (1500, None)}
CATALOG_SEED = 233             # the seed WebShop shuffles its goals with
PRICE_CLAUSE = ", and price lower than "

WEBSHOP_ENV_DEFAULTS = dict(max_steps=15, dense_view_weight=0.2, dense_option_bonus=0.1,
                            dense_buy_weight=1.0)
WEBSHOP_CATALOG_DEFAULTS = dict(num_products=1000, goals_per_product=6, no_options_prob=0.15)
WEBSHOP_OPTIONS = {   # specs for check_options; human_goals is backend="real" only
    **{k: _number_spec(True, 1) for k in ("max_steps", "num_products", "goals_per_product")},
    "no_options_prob": _number_spec(False, 0, 1),
    **{k: _number_spec(False) for k in ("dense_view_weight", "dense_option_bonus", "dense_buy_weight")},
    "human_goals": ("true or false", lambda value: isinstance(value, bool)),
    "results_names": ("'asin' or 'position'", lambda value: value in ("asin", "position")),
}

# ---------------------------------------------------------------------------------------------
# Vocabulary tables. Option values never occur inside a product's title, bullets or description
# (goal.py would otherwise count a wrongly chosen option as matched), and no two attributes of a
# category match each other fuzzily; test_rspo.py checks both.
# ---------------------------------------------------------------------------------------------
BRANDS = ["Aurelo", "Brivan", "Calyx", "Dovani", "Elmora", "Fenwick", "Gallio", "Harlow",
          "Istra", "Jovik", "Kestrel", "Lumen", "Mavro", "Norvik", "Orla", "Pavia"]
TITLE_WORDS = ["Classic", "Premium", "Essential", "Signature", "Deluxe", "Modern"]
INSTRUCTION_OPENERS = ["i am looking for", "i need", "i want to buy", "find me", "i would like"]

# Option groups: group name -> the values a product draws from (in display order).
OPTION_POOLS = {
    "color": ["black", "white", "navy", "grey", "beige", "olive", "pink", "burgundy"],
    "size": ["small", "medium", "large", "x-large"],
    "shoe size": ["7", "8", "9", "10", "11", "12"],
    "scent": ["lavender", "coconut", "citrus", "eucalyptus", "unscented"],
    "volume": ["1 fl oz", "3.4 fl oz", "8 fl oz", "16 fl oz"],
    "pack": ["1 pack", "2 pack", "4 pack"],
    "flavor": ["vanilla", "caramel", "almond", "honey", "cinnamon", "peppermint"],
    "count": ["6 count", "12 count", "24 count"],
    "finish": ["walnut", "espresso", "natural oak", "matte black"],
    "width": ["24 inch", "30 inch", "36 inch"],
}

# A product type: (query, title words, department, nouns in the title, plural?, option groups).
# `query` is what WebShop calls the product's search query; it names the type in instructions.
WEBSHOP_CATEGORIES = {
    "beauty": dict(
        path="Beauty & Personal Care", price=(4.0, 38.0),
        attributes=["long lasting", "paraben free", "cruelty free", "sensitive skin",
                    "natural ingredients", "dermatologist tested", "vegan formula",
                    "fragrance free"],
        types=[("lipstick", "Lipstick", "Makeup", ["lipstick"], False, ["color"]),
               ("nail polish", "Nail Polish", "Makeup", ["nail", "polish"], False, ["color"]),
               ("face moisturizer", "Face Moisturizer", "Skin Care", ["face", "moisturizer"],
                False, ["volume"]),
               ("shampoo", "Shampoo", "Hair Care", ["shampoo"], False, ["scent", "volume"]),
               ("body wash", "Body Wash", "Skin Care", ["body", "wash"], False,
                ["scent", "volume"])]),
    "electronics": dict(
        path="Electronics", price=(8.0, 75.0),
        attributes=["fast charging", "noise cancelling", "water resistant", "long battery life",
                    "high speed", "easy install", "aluminum alloy", "plug and play"],
        types=[("wireless earbuds", "Wireless Earbuds", "Headphones", ["earbuds"], True,
                ["color"]),
               ("bluetooth speaker", "Bluetooth Speaker", "Audio", ["speaker"], False,
                ["color"]),
               ("power bank", "Power Bank", "Accessories", ["power", "bank"], False,
                ["color", "pack"]),
               ("hdmi cable", "HDMI Cable", "Accessories", ["hdmi", "cable"], False, ["pack"]),
               ("laptop stand", "Laptop Stand", "Accessories", ["laptop", "stand"], False,
                ["color"])]),
    "fashion": dict(
        path="Clothing, Shoes & Jewelry", price=(9.0, 60.0),
        attributes=["machine wash", "slim fit", "quick dry", "long sleeve", "elastic waist",
                    "relaxed fit", "button closure", "non slip"],
        types=[("t-shirt", "T-Shirt", "Men", ["shirt"], False, ["color", "size"]),
               ("hoodie", "Hoodie", "Men", ["hoodie"], False, ["color", "size"]),
               ("yoga pants", "Yoga Pants", "Women", ["yoga", "pants"], True,
                ["color", "size"]),
               ("summer dress", "Summer Dress", "Women", ["summer", "dress"], False,
                ["color", "size"]),
               ("running shoes", "Running Shoes", "Shoes", ["running", "shoes"], True,
                ["color", "shoe size"])]),
    "food": dict(
        path="Grocery & Gourmet Food", price=(3.0, 30.0),
        attributes=["gluten free", "non gmo", "high protein", "low calorie", "certified organic",
                    "keto friendly", "individually wrapped", "no artificial flavors"],
        types=[("granola bars", "Granola Bars", "Snacks", ["granola", "bars"], True,
                ["flavor", "count"]),
               ("herbal tea", "Herbal Tea", "Beverages", ["herbal", "tea"], False, ["flavor"]),
               ("coffee beans", "Coffee Beans", "Beverages", ["coffee", "beans"], True,
                ["flavor"]),
               ("trail mix", "Trail Mix", "Snacks", ["trail", "mix"], False, ["count"]),
               ("dark chocolate", "Dark Chocolate", "Snacks", ["chocolate"], False,
                ["flavor", "count"])]),
    "furniture": dict(
        path="Home & Kitchen", price=(25.0, 180.0),
        attributes=["easy assembly", "solid wood", "space saving", "heavy duty", "metal frame",
                    "adjustable height", "storage shelf", "living room"],
        types=[("office chair", "Office Chair", "Furniture", ["office", "chair"], False,
                ["color"]),
               ("bookshelf", "Bookshelf", "Furniture", ["bookshelf"], False, ["finish", "width"]),
               ("coffee table", "Coffee Table", "Furniture", ["coffee", "table"], False,
                ["finish"]),
               ("bar stool", "Bar Stool", "Furniture", ["bar", "stool"], False,
                ["finish", "pack"]),
               ("tv stand", "TV Stand", "Furniture", ["tv", "stand"], False, ["finish", "width"])]),
}

DESCRIPTIONS = [
    "The {type} from {brand} is built for daily use and tested for quality. {attrs}.",
    "Meet the {brand} {type}: simple, reliable and made to last. {attrs}.",
    "{brand} designs every {type} with care, so it keeps its promise day after day. {attrs}.",
]
BULLET_PITCHES = ["made for everyday comfort", "trusted by thousands of shoppers",
                  "checked by our quality team", "a favorite for gifting",
                  "designed with care in every detail"]
REVIEWS = [("Great value", 5, "Works as described and arrived on time."),
           ("Happy with it", 4, "Good quality for the price."),
           ("Just okay", 3, "Does the job but nothing special."),
           ("Disappointed", 2, "Quality was not what I expected.")]
RESULTS_HEADER = "Page {page} (Total results: {total})"
DONE_PAGE = "Thank you for shopping with us!" + SEP + "Your score (min 0.0, max 1.0)"


# ---------------------------------------------------------------------------------------------
# Fuzzy matching: fuzzywuzzy's token_set_ratio with difflib
# ---------------------------------------------------------------------------------------------
def _fuzz_process(text):
    """fuzzywuzzy's full_process: non-alphanumerics to spaces, lower-case, trimmed."""
    return " ".join(re.sub(r"\W", " ", text.lower()).split())


def _ratio(a, b):
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


@functools.lru_cache(maxsize=1 << 16)   # the catalog's phrases are few; difflib is slow
def token_set_ratio(a, b):
    """fuzzywuzzy.fuzz.token_set_ratio: compare the shared tokens with each side's full set."""
    tokens_a, tokens_b = set(_fuzz_process(a).split()), set(_fuzz_process(b).split())
    if not tokens_a or not tokens_b:
        return 0
    shared = " ".join(sorted(tokens_a & tokens_b))
    with_a = (shared + " " + " ".join(sorted(tokens_a - tokens_b))).strip()
    with_b = (shared + " " + " ".join(sorted(tokens_b - tokens_a))).strip()
    return max(_ratio(shared, with_a), _ratio(shared, with_b), _ratio(with_a, with_b))


# ---------------------------------------------------------------------------------------------
# Reward: WebShop's engine/goal.py, with product and goal dicts that use WebShop's field names
# ---------------------------------------------------------------------------------------------
def webshop_type_reward(product, goal):
    """r_type: 1, or 0.5 when neither query, >= 2 category levels nor > 0.2 of the goal title's
    nouns match; 0.1 when under 0.1 of the nouns match; 0 when none. Nouns come from the
    generator (`nouns` field) instead of spaCy's tagger."""
    query_match = product["query"] == goal["query"]
    levels = lambda p: {x.strip() for x in p["product_category"].split("›")}
    category_match = len(levels(product) & levels(goal)) >= 2
    goal_nouns = set(goal["nouns"])
    title_score = len(set(product["nouns"]) & goal_nouns) / len(goal_nouns) if goal_nouns else 0.2
    r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type


def _in_product_text(product, phrase):
    """goal.py's fallback: a phrase inside the title, the bullets or the description."""
    return (phrase in product["Title"].lower()
            or phrase in " ".join(product["BulletPoints"]).lower()
            or phrase in product["Description"].lower())


def webshop_attribute_matches(product, goal_attributes):
    """How many goal attributes the product has: fuzzy > 85 against its attributes, else a
    substring of its title, bullets or description."""
    return sum(1 for g in goal_attributes
               if any(token_set_ratio(p, g) > FUZZY_THRESHOLD for p in product["Attributes"])
               or _in_product_text(product, g))


def option_value_matches(group, value, goal_values):
    """One chosen option against the goal's option values: exact for size, fuzzy > 85 else."""
    if group.lower() in EXACT_MATCH_OPTS:
        return value in goal_values
    return any(token_set_ratio(g, value) > FUZZY_THRESHOLD for g in goal_values)


def webshop_option_matches(product, goal_values, chosen_options):
    """How many chosen options match (goal.py iterates over the *chosen* options; a chosen value
    found in the product's texts also counts)."""
    return sum(1 for group, value in chosen_options.items()
               if option_value_matches(group, value, goal_values)
               or _in_product_text(product, value))


def webshop_reward(product, goal, price, options):
    """r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[price <= cap]) / (|U_att| + |U_opt| + 1)."""
    goal_values = list(goal["goal_options"].values())
    matched = (webshop_attribute_matches(product, goal["attributes"])
               + webshop_option_matches(product, goal_values, options)
               + (price <= goal["price_upper"]))
    total = len(goal["attributes"]) + len(goal_values) + 1
    return webshop_type_reward(product, goal) * matched / total


# ---------------------------------------------------------------------------------------------
# Catalog generation
# ---------------------------------------------------------------------------------------------
def _asin(rng, taken):
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _join_and(words):
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _make_product(rng, category, taken_asins, no_options_prob):
    spec = WEBSHOP_CATEGORIES[category]
    query, type_title, department, nouns, plural, groups = rng.choice(spec["types"])
    brand = rng.choice(BRANDS)
    attributes = rng.sample(spec["attributes"], rng.randint(3, 4))
    title = (f"{brand} {rng.choice(TITLE_WORDS)} {type_title} - "
             f"{attributes[0].title()}, {attributes[1].title()}")
    options = {}
    if rng.random() >= no_options_prob:
        for group in groups:
            pool = OPTION_POOLS[group]
            chosen = set(rng.sample(pool, rng.randint(2, min(4, len(pool)))))
            options[group] = [v for v in pool if v in chosen]
    low, high = spec["price"]
    first = round(rng.uniform(low, high), 2)
    if rng.random() < 0.25:
        pricing = [first, round(first * rng.uniform(1.2, 1.8), 2)]
        price_tag = f"${pricing[0]} to ${pricing[1]}"
        price = round(rng.uniform(*pricing), 2)
    else:
        pricing, price_tag, price = [first], f"${first}", first
    description = rng.choice(DESCRIPTIONS).format(
        type=query, brand=brand, attrs=_join_and(attributes).capitalize())
    bullets = [f"{a.capitalize()}: {rng.choice(BULLET_PITCHES)}" for a in attributes]
    reviews = [dict(title=t, score=s, body=b) for t, s, b in rng.sample(REVIEWS, rng.randint(0, 2))]
    return dict(asin=_asin(rng, taken_asins), category=category, query=query,
                product_category=" › ".join([spec["path"], department, type_title]),
                Title=title, name=title, nouns=[brand.lower()] + nouns, plural=plural,
                Price=price_tag, pricing=pricing, price=price, Rating="N.A.",
                Attributes=attributes, options=options, Description=description,
                BulletPoints=bullets, Reviews=reviews)


def _instruction_base(rng, product, attributes):
    """The instruction before options and price, e.g. `i need a gluten free herbal tea`."""
    opener = rng.choice(INSTRUCTION_OPENERS)
    if rng.random() < 0.5:
        words = f"{_join_and(attributes)} {product['query']}"
    else:
        verb = "are" if product["plural"] else "is"
        words = f"{product['query']} that {verb} {_join_and(attributes)}"
    article = "some" if product["plural"] else "an" if words[0] in "aeiou" else "a"
    return f"{opener} {article} {words}"


def _make_goal(rng, product, goal_options):
    """One goal as WebShop's get_synthetic_goals builds it: instruction over 1-3 of the product's
    attributes, the goal options appended, a price cap a little above the price."""
    attributes = rng.sample(product["Attributes"], rng.randint(1, 3))
    caps = [p for p in PRICE_RANGE if p > product["price"]][:4]
    price_upper = max(rng.sample(caps, 2))
    option_text = ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
    option_text = " with " + option_text if option_text else ""
    instruction = (f"{_instruction_base(rng, product, attributes)}{option_text}"
                   f"{PRICE_CLAUSE}{price_upper:.2f} dollars")
    return dict(asin=product["asin"], category=product["category"], query=product["query"],
                name=product["Title"], nouns=product["nouns"],
                product_category=product["product_category"], instruction_text=instruction,
                attributes=attributes, price_upper=price_upper, goal_options=goal_options)


def _make_goals(rng, product, goals_per_product, seen):
    """`goals_per_product` goals: the option combinations in a fixed shuffled order (cycled when
    there are fewer), each with its own attributes, wording and price cap; an instruction already
    in `seen` (from any product) is skipped, so no instruction is in two splits."""
    groups = sorted(product["options"])
    combos = list(itertools.product(*(product["options"][g] for g in groups)))
    rng.shuffle(combos)
    goals = []
    for k in range(4 * goals_per_product):   # a few retries for duplicate instructions
        goal = _make_goal(rng, product, dict(zip(groups, combos[k % len(combos)])))
        if goal["instruction_text"] not in seen:
            seen.add(goal["instruction_text"])
            goals.append(goal)
        if len(goals) == goals_per_product:
            break
    return goals


def _tokens(text):
    return re.findall(r"\w+", text.lower())


class WebShopCatalog:
    """Products, shuffled goals and a BM25 search engine over title + attributes."""

    K1, B = 0.9, 0.4

    def __init__(self, products, goals):
        self.products = products
        self.goals = goals
        self.index_of = {p["asin"]: i for i, p in enumerate(products)}
        docs = [_tokens(p["Title"] + " " + " ".join(p["Attributes"])) for p in products]
        mean_len = sum(map(len, docs)) / max(1, len(docs))
        self.postings = {}
        for i, doc in enumerate(docs):
            norm = self.K1 * (1 - self.B + self.B * len(doc) / mean_len)
            for term in set(doc):
                tf = doc.count(term)
                self.postings.setdefault(term, []).append((i, tf * (self.K1 + 1) / (tf + norm)))
        n = len(docs)
        self.idf = {t: math.log(1 + (n - len(p) + 0.5) / (len(p) + 0.5))
                    for t, p in self.postings.items()}
        self._cache = {}

    def search(self, query):
        """Indices of the top 50 products for a free-text query (BM25, ties by catalog order)."""
        terms = tuple(_tokens(query))
        if terms not in self._cache:
            if len(self._cache) > 100_000:   # free-text queries from a generating model
                self._cache.clear()
            scores = {}
            for term in terms:
                for i, weight in self.postings.get(term, ()):
                    scores[i] = scores.get(i, 0.0) + self.idf[term] * weight
            ranked = sorted(scores, key=lambda i: (-scores[i], i))
            self._cache[terms] = ranked[:SEARCH_RETURN_N]
        return self._cache[terms]


def build_webshop_catalog(num_products=1000, goals_per_product=6, no_options_prob=0.15):
    """The deterministic catalog and goal list; cached, so every env of one size shares it."""
    check_options("WebShop", dict(num_products=num_products, goals_per_product=goals_per_product,
                                  no_options_prob=no_options_prob), WEBSHOP_OPTIONS)
    return _generate_catalog(num_products, goals_per_product, no_options_prob)


@functools.lru_cache(maxsize=4)
def _generate_catalog(num_products, goals_per_product, no_options_prob):
    rng = random.Random(CATALOG_SEED)
    taken = set()
    categories = sorted(WEBSHOP_CATEGORIES)
    products = [_make_product(rng, categories[i % len(categories)], taken, no_options_prob)
                for i in range(num_products)]
    seen = set()
    goals = [g for p in products for g in _make_goals(rng, p, goals_per_product, seen)]
    random.Random(CATALOG_SEED).shuffle(goals)
    return WebShopCatalog(products, goals)


def _catalog_and_env_options(options):
    """Split **options into catalog and env options; a clear error for unknown names or bad values."""
    known = set(WEBSHOP_CATALOG_DEFAULTS) | set(WEBSHOP_ENV_DEFAULTS) | {"results_names"}   # the last: the wrapper's
    unknown = set(options) - known
    if unknown:
        raise ValueError(f"webshop: unknown option(s) {sorted(unknown)}; known: {sorted(known)}")
    check_options("WebShop", options, WEBSHOP_OPTIONS)
    catalog = {k: options.get(k, v) for k, v in WEBSHOP_CATALOG_DEFAULTS.items()}
    env = {k: options.get(k, v) for k, v in WEBSHOP_ENV_DEFAULTS.items()}
    return catalog, env


def _split_range(split, num_goals):
    if split not in WEBSHOP_SPLITS:
        raise ValueError(f"webshop: unknown split {split!r}; use one of {sorted(WEBSHOP_SPLITS)}")
    start, end = WEBSHOP_SPLITS[split]
    end = num_goals if end is None else end
    if num_goals <= WEBSHOP_SPLITS["train"][0]:
        raise ValueError(f"webshop: the catalog has only {num_goals} goals; test, dev and train "
                         f"need more than 1500 (raise num_products or goals_per_product)")
    return start, end


def webshop_num_tasks(split, **options):
    """Number of goals in a split's fixed list."""
    catalog_options, _ = _catalog_and_env_options(options)
    start, end = _split_range(split, len(build_webshop_catalog(**catalog_options).goals))
    return end - start


def webshop_search_queries(goal):
    """The concrete queries listed on the search page, all derived from the instruction."""
    instruction = goal["instruction_text"]
    without_price = instruction.split(PRICE_CLAUSE)[0]
    keywords = " ".join(goal["attributes"] + [goal["query"]])
    return sorted({instruction, without_price, keywords, goal["query"]})


# ---------------------------------------------------------------------------------------------
# Pages (text mode: visible texts joined by " [SEP] ")
# ---------------------------------------------------------------------------------------------
def render_search_page(instruction):
    return SEP.join(["WebShop", "Instruction:", instruction, "Search"])


def _page_head(instruction):
    return ["Instruction:", instruction, "Back to Search"]


def render_results_page(instruction, products, page, total):
    """`products` are the (at most 10) products shown on this page."""
    parts = _page_head(instruction) + [RESULTS_HEADER.format(page=page, total=total)]
    if page > 1:
        parts.append("< Prev")
    if page * PRODUCT_WINDOW < total:
        parts.append("Next >")
    for p in products:
        parts += [p["asin"], p["Title"], p["Price"]]
    return SEP.join(parts)


def render_item_page(instruction, product):
    parts = _page_head(instruction) + ["< Prev"]
    for group, values in product["options"].items():
        parts += [group] + values
    parts += [product["Title"], f"Price: {product['Price']}", f"Rating: {product['Rating']}",
              "Description", "Features", "Reviews", "Buy Now"]
    return SEP.join(parts)


def render_sub_page(instruction, product, sub_page):
    if sub_page == "description":
        body = [product["Description"]]
    elif sub_page == "features":
        body = list(product["BulletPoints"])
    else:
        body = [x for r in product["Reviews"] for x in (f'"{r["title"]}"', str(r["score"]), r["body"])]
        body = body or ["No reviews found"]
    return SEP.join(_page_head(instruction) + ["< Prev"] + body)


def render_done_page(reward):
    return f"{DONE_PAGE}{SEP}{reward:.2f}"


def parse_instruction(instruction):
    """What an instruction asks for, read from its text: the options after ` with ` and the price
    cap, e.g. `... dress with color: navy, and size: small, and price lower than 80.00 dollars` ->
    ({"color": "navy", "size": "small"}, 80.0)."""
    text, _, price = instruction.partition(PRICE_CLAUSE)
    budget = float(price.split()[0]) if price else math.inf
    options = text.partition(" with ")[2]
    wanted = dict(o.split(": ", 1) for o in options.split(", and ")) if options else {}
    return wanted, budget


def price_bounds(price_tag):
    """A shown price tag, `$12.5` or `$5.25 to $6.84`, as (lowest, highest)."""
    prices = [float(x) for x in re.findall(r"\$([\d.]+)", price_tag)]
    return prices[0], prices[-1]


def parse_action(action):
    """engine.py's parse_action: `name[arg]` -> (name, arg); anything else -> (action, None)."""
    m = re.match(r"(.+)\[(.+)\]", action) if isinstance(action, str) else None
    return (m.group(1), m.group(2)) if m else (action, None)


# ---------------------------------------------------------------------------------------------
# The offline environment
# ---------------------------------------------------------------------------------------------
class WebShopEnv:
    """One WebShop session on a fixed goal: search -> results -> item (-> sub-page) -> buy."""

    def __init__(self, catalog, goal, max_steps=15, dense_view_weight=0.2,
                 dense_option_bonus=0.1, dense_buy_weight=1.0):
        self.catalog, self.goal, self.max_steps = catalog, goal, max_steps
        self.dense_weights = (dense_view_weight, dense_option_bonus, dense_buy_weight)
        self.target = catalog.index_of[goal["asin"]]
        self.queries = webshop_search_queries(goal)
        self.reset()

    # -- session state -------------------------------------------------------------------------
    def _new_session(self):
        """The search page, as after reset or `back to search`: nothing searched or chosen."""
        self.page, self.keywords, self.results, self.page_num = "search", None, [], 1
        self.asin, self.options, self.sub_page = None, {}, None

    def reset(self):
        self._new_session()
        self.searched, self.opened = set(), set()   # this episode's queries and opened asins
        self.steps, self.done, self.won, self.reward = 0, False, False, 0.0
        self.obs = self._render()
        self.info = self._info(dense=0.0, score=0.0)
        return self.obs, dict(self.info)

    def _product(self):
        return self.catalog.products[self.asin]

    def clickables(self):
        """Lower-cased texts that `click[...]` accepts on the current page."""
        if self.page == "results":
            shown = self.results[(self.page_num - 1) * PRODUCT_WINDOW:self.page_num * PRODUCT_WINDOW]
            return ([BACK_TO_SEARCH] + ([PREV_PAGE] if self.page_num > 1 else [])
                    + ([NEXT_PAGE] if self.page_num * PRODUCT_WINDOW < len(self.results) else [])
                    + [self.catalog.products[i]["asin"].lower() for i in shown])
        if self.page == "item":
            values = [v for vs in self._product()["options"].values() for v in vs]
            return [BACK_TO_SEARCH, PREV_PAGE] + values + list(SUB_PAGES) + [BUY_NOW]
        if self.page == "sub":
            return [BACK_TO_SEARCH, PREV_PAGE]
        return []   # search page (its only button, `search`, is not clickable) and done page

    def admissible_actions(self):
        if self.done:
            return []
        actions = {f"click[{c}]" for c in self.clickables()}
        if self.page == "search":
            actions |= {f"search[{q}]" for q in self.queries}
        return sorted(actions)

    def _render(self):
        instruction = self.goal["instruction_text"]
        if self.page == "search":
            return render_search_page(instruction)
        if self.page == "results":
            start = (self.page_num - 1) * PRODUCT_WINDOW
            shown = [self.catalog.products[i] for i in self.results[start:start + PRODUCT_WINDOW]]
            return render_results_page(instruction, shown, self.page_num, len(self.results))
        if self.page == "item":
            return render_item_page(instruction, self._product())
        if self.page == "sub":
            return render_sub_page(instruction, self._product(), self.sub_page)
        return render_done_page(self.reward)

    def _current_reward(self):
        """The reward formula for the product on screen with the options chosen so far."""
        product = self._product()
        return webshop_reward(product, self.goal, product["price"], self.options)

    def progress(self):
        if self.page == "done":
            return self.reward
        return self._current_reward() if self.page in ("item", "sub") else 0.0

    def _info(self, dense, score):
        return dict(admissible_actions=self.admissible_actions(), won=self.won,
                    task=self.goal["instruction_text"], task_type=self.goal["category"],
                    progress=self.progress(), dense_reward=dense, score=score)

    # -- transitions ---------------------------------------------------------------------------
    def _search(self, keywords):
        self.page, self.keywords, self.page_num = "results", keywords, 1
        self.searched.add(keywords)
        self.results = self.catalog.search(keywords)
        self.asin, self.options = None, {}

    def _click(self, name):
        """Apply a click on a current clickable; returns the dense-reward event it triggers."""
        page = self.page
        if name == BACK_TO_SEARCH:
            self._new_session()
        elif name == BUY_NOW:
            self.reward = self._current_reward()
            self.page, self.done, self.won = "done", True, self.reward == 1.0
            return "buy"
        elif page == "results" and name in (NEXT_PAGE, PREV_PAGE):
            self.page_num += 1 if name == NEXT_PAGE else -1
        elif page == "results":
            self.page, self.asin, self.options = "item", self.catalog.index_of[name.upper()], {}
            self.opened.add(name)
            return "view"
        elif page == "sub":   # `< prev`: back to the item page, options kept
            self.page = "item"
            return "view"
        elif name == PREV_PAGE:   # from an item page: the same results page, options reset
            self.page, self.asin, self.options = "results", None, {}
        elif name in SUB_PAGES:
            self.page, self.sub_page = "sub", name
        else:   # an option value on the item page
            group = next(g for g, vs in self._product()["options"].items() if name in vs)
            self.options[group] = name
            goal_values = list(self.goal["goal_options"].values())
            return "goal option" if option_value_matches(group, name, goal_values) else None
        return None

    def _dense_reward(self, event):
        view_weight, option_bonus, buy_weight = self.dense_weights
        if event == "view":
            return view_weight * self._current_reward()
        if event == "goal option":
            return option_bonus
        if event == "buy":
            return buy_weight * self.reward
        return 0.0

    def step(self, action):
        if self.done:
            info = dict(self.info, dense_reward=0.0, score=0.0)
            return self.obs, 0.0, True, info
        self.steps += 1
        name, arg = parse_action(action)
        arg = arg.lower() if arg is not None else None
        event = None
        if name == "search" and arg:
            self._search(arg)
        elif name == "click" and arg in self.clickables():
            event = self._click(arg)
        reward = self.reward if event == "buy" else 0.0
        self.done = self.done or self.steps >= self.max_steps
        self.obs = self._render()
        self.info = self._info(dense=self._dense_reward(event), score=reward)
        return self.obs, reward, self.done, dict(self.info)

    # -- scripted expert -----------------------------------------------------------------------
    def _rank_of_target(self, results):
        return results.index(self.target) if self.target in results else None

    def expert_query(self):
        """The listed query that ranks the goal product highest (its title if none finds it)."""
        ranked = [(self._rank_of_target(self.catalog.search(q)), q) for q in self.queries]
        found = [(rank, q) for rank, q in ranked if rank is not None]
        return min(found)[1] if found else self.catalog.products[self.target]["Title"].lower()

    def expert_action(self):
        """The scripted expert's next action from the current state: reach the goal product's
        item page, choose the goal options, buy."""
        if self.done:
            return f"click[{BUY_NOW}]"   # ignored after done, like any action
        if self.page in ("item", "sub") and self.asin == self.target:
            if self.page == "sub":
                return f"click[{PREV_PAGE}]"
            for group, value in self.goal["goal_options"].items():
                if self.options.get(group) != value:
                    return f"click[{value}]"
            return f"click[{BUY_NOW}]"
        in_results = self._rank_of_target(self.results) if self.keywords else None
        if self.page in ("item", "sub"):
            return f"click[{PREV_PAGE if in_results is not None else BACK_TO_SEARCH}]"
        if self.page == "results":
            if in_results is None:
                return f"click[{BACK_TO_SEARCH}]"
            target_page = in_results // PRODUCT_WINDOW + 1
            if target_page == self.page_num:
                return f"click[{self.catalog.products[self.target]['asin'].lower()}]"
            return f"click[{NEXT_PAGE if target_page > self.page_num else PREV_PAGE}]"
        return f"search[{self.expert_query()}]"

    # -- non-privileged demonstrator -----------------------------------------------------------
    def searching_action(self):
        """A demonstrator's next action from what an agent sees, unlike `expert_action`.

        Sees: the instruction, the current page (a results page's asins, titles and price tags in
        their shown order; an item page's option groups and values), the listed search queries,
        the step count and cap, and what was done this episode (queries searched, products opened,
        options clicked on this item page). Never reads the goal's product, attributes, options or
        query, a product's hidden fields (attributes, exact price, nouns, category) or the reward.

        Rule: search the instruction without its price clause (a listed query); open the best-ranked
        shown product not opened yet whose price tag can fit the budget, one wholly under it first;
        on its page click the instruction's option values and buy, or go back for the next result
        when a stated value is not offered and enough steps are left to try another.
        """
        if self.done:
            return f"click[{BUY_NOW}]"   # ignored after done, like any action
        wanted, budget = parse_instruction(self.goal["instruction_text"])
        # The search engine ranks by title and attribute words: option values and the price clause
        # only add noise, so the instruction without its price clause is the query to use first.
        core = self.goal["instruction_text"].split(PRICE_CLAUSE)[0].lower()
        queries = sorted((q.lower() for q in self.queries), key=lambda q: (q != core, -len(q)))
        if self.page == "search":
            fresh = [q for q in queries if q not in self.searched]
            return f"search[{(fresh or queries)[0]}]"
        if self.page == "results" and queries[0] not in self.searched:   # another query's results
            return f"click[{BACK_TO_SEARCH}]"
        if self.page == "results":
            start = (self.page_num - 1) * PRODUCT_WINDOW
            fitting = []   # (may exceed the budget, rank on page, asin)
            for rank, i in enumerate(self.results[start:start + PRODUCT_WINDOW]):
                product = self.catalog.products[i]
                low, high = price_bounds(product["Price"])
                if product["asin"].lower() not in self.opened and low <= budget:
                    fitting.append((high > budget, rank, product["asin"].lower()))
            if fitting:   # the ranking also weighs words titles don't show; it beat title overlap
                return f"click[{min(fitting)[-1]}]"
            if NEXT_PAGE in self.clickables():
                return f"click[{NEXT_PAGE}]"
            return f"click[{BACK_TO_SEARCH}]"   # then the next listed query
        if self.page == "sub":
            return f"click[{PREV_PAGE}]"
        offered = self._product()["options"]
        if (not all(v in offered.get(g, ()) for g, v in wanted.items())
                and self.max_steps - self.steps >= len(wanted) + 3):   # < prev, open, choose, buy
            return f"click[{PREV_PAGE}]"
        for group, value in wanted.items():   # out of steps: buy with what is offered
            if value in offered.get(group, ()) and self.options.get(group) != value:
                return f"click[{value}]"
        return f"click[{BUY_NOW}]"


# ---------------------------------------------------------------------------------------------
# Adapter to the real WebShop (princeton-nlp/WebShop checkout at $WEBSHOP_ROOT)
# ---------------------------------------------------------------------------------------------
class RealWebShopEnv:
    """Thin wrapper of WebShop's `WebAgentTextEnv` (text mode) into this interface.

    Goal `i` of a split is WebShop's session `i` (test = 0-499, dev = 500-1499, train = the rest,
    as in the paper). `progress` and `dense_reward` use WebShop's own `get_reward` on the session's
    current product and options. Needs the checkout's data, search index, Java and spaCy model.
    """

    def __init__(self, split="train", seed=0, max_steps=15, num_products=None, human_goals=True,
                 dense_view_weight=0.2, dense_option_bonus=0.1, dense_buy_weight=1.0):
        root = os.environ.get("WEBSHOP_ROOT")
        if not root:
            raise RuntimeError("webshop backend='real' needs a princeton-nlp/WebShop checkout: set "
                               "WEBSHOP_ROOT to it (after its setup.sh) or use backend='offline'")
        if root not in sys.path:
            sys.path.insert(0, root)
        try:
            from web_agent_site.envs.web_agent_text_env import WebAgentTextEnv
            from web_agent_site.engine.goal import get_reward
        except Exception as exc:   # ImportError, or a missing spaCy model / Java at import time
            raise RuntimeError(f"webshop backend='real': cannot import web_agent_site from "
                               f"WEBSHOP_ROOT={root} ({type(exc).__name__}: {exc}); install the "
                               f"checkout's requirements (setup.sh)") from exc
        self._get_reward = get_reward
        self.env = WebAgentTextEnv(observation_mode="text", num_products=num_products,
                                   human_goals=human_goals)
        start, end = _split_range(split, len(self.env.server.goals))
        self.session_index = start + seed % (end - start)
        self.max_steps = max_steps
        self.dense_weights = (dense_view_weight, dense_option_bonus, dense_buy_weight)

    def _session(self):
        return self.env.server.user_sessions[self.env.session]

    def _page_name(self):
        return self.env.server.get_page_name(self.env.browser.current_url)

    def _current_reward(self):
        session = self._session()
        if not session.get("asin"):
            return 0.0
        server = self.env.server
        return float(self._get_reward(server.product_item_dict[session["asin"]], session["goal"],
                                      price=server.product_prices.get(session["asin"]),
                                      options=session["options"]))

    def _info(self, dense, score):
        available = None if self.done else self.env.get_available_actions()
        actions = []
        if available:
            actions = [f"click[{c}]" for c in available["clickables"] if c != "search"]
            if available["has_search_bar"]:
                actions += [f"search[{q}]" for q in self.queries]
        if self.bought:
            progress = self.reward
        elif self._page_name() in ("item_page", "item_sub_page"):
            progress = self._current_reward()
        else:
            progress = 0.0
        return dict(admissible_actions=sorted(set(actions)), won=self.won, task=self.task,
                    task_type=self._session()["goal"].get("category", "webshop"),
                    progress=progress, dense_reward=dense, score=score)

    def reset(self):
        self.obs, _ = self.env.reset(session=self.session_index)
        goal = self._session()["goal"]
        self.task = goal["instruction_text"]
        instruction = self.task.lower()
        self.queries = sorted({instruction, instruction.split(PRICE_CLAUSE)[0],
                               " ".join(goal.get("attributes", []) + [goal.get("query", "")]).strip()}
                              - {""})
        self.steps, self.done, self.won, self.bought, self.reward = 0, False, False, False, 0.0
        self.info = self._info(dense=0.0, score=0.0)
        return self.obs, dict(self.info)

    def expert_action(self):
        raise NotImplementedError("the real WebShop has no scripted expert; use backend='offline'")

    def step(self, action):
        if self.done:
            return self.obs, 0.0, True, dict(self.info, dense_reward=0.0, score=0.0)
        page_before = self._page_name()
        self.obs, reward, done, _ = self.env.step(action)
        self.steps += 1
        view_weight, option_bonus, buy_weight = self.dense_weights
        dense, score = 0.0, 0.0
        if done:   # only `buy now` ends a WebShop session
            self.reward = score = float(reward)
            self.bought, self.won = True, self.reward == 1.0
            dense = buy_weight * self.reward
        elif self._page_name() == "item_page":
            _, clicked = parse_action(action)
            clicked = (clicked or "").lower()
            options = self._session()["options"]
            if page_before != "item_page":
                dense = view_weight * self._current_reward()
            elif clicked in options.values():   # an option click (also a repeated one)
                group = next(g for g, v in options.items() if v == clicked)
                goal_options = self._session()["goal"]["goal_options"]   # dict, or list for human goals
                goal_values = list(goal_options.values() if isinstance(goal_options, dict)
                                   else goal_options)
                if option_value_matches(group, clicked, goal_values):
                    dense = option_bonus
        self.done = done or self.steps >= self.max_steps
        self.info = self._info(dense=dense, score=score)
        return self.obs, score, self.done, dict(self.info)


# ---------------------------------------------------------------------------------------------
# Results named by position: what a small word-level policy reads and clicks (results_names="position")
# ---------------------------------------------------------------------------------------------
POSITION_NAMES = [f"item{k}" for k in range(1, PRODUCT_WINDOW + 1)]
RESULTS_PAGE = re.compile(r"Page \d+ \(Total results: \d+\)")


class PositionNamedResults:
    """A WebShop env (either backend) whose results pages name their products item1, item2, ... in the order
    listed, instead of by ASIN: to a word-level tokenizer each ASIN is a word met in a handful of demonstrations
    at most, so a tiny policy cannot learn to click the product it means (results/diagnosis/README.md at 25efb16, "WebShop's
    product click"). A click on itemK reaches the env as that product's ASIN; the env's own text, rules and
    rewards are unchanged underneath, and every other method and attribute is the env's."""

    def __init__(self, env):
        self.env, self.to_name = env, {}   # this page's ASIN (as clicked) -> its name

    def __getattr__(self, name):
        return getattr(self.env, name)

    def _rename(self, obs, info):
        # A listed product is a clickable whose upper-cased text is on a results page (the page prints ASINs
        # upper-cased, the clicks lower-cased); on an item page letter-less option values (shoe sizes) would match.
        listed = []
        if RESULTS_PAGE.search(obs):
            clicks = [arg for name, arg in map(parse_action, info["admissible_actions"]) if name == "click"]
            listed = sorted((obs.find(c.upper()), c) for c in clicks if c.upper() in obs)
        self.to_name = {c: name for name, (_, c) in zip(POSITION_NAMES, listed)}
        for c, name in self.to_name.items():
            obs = obs.replace(c.upper(), name)
        return obs, {**info, "admissible_actions": sorted(self._named(a) for a in info["admissible_actions"])}

    def _named(self, action):
        name, arg = parse_action(action)
        return f"click[{self.to_name[arg]}]" if name == "click" and arg in self.to_name else action

    def reset(self):
        return self._rename(*self.env.reset())

    def step(self, action):
        name, arg = parse_action(action)
        to_asin = {named: c for c, named in self.to_name.items()}
        if name == "click" and arg in to_asin:
            action = f"click[{to_asin[arg]}]"
        obs, reward, done, info = self.env.step(action)
        obs, info = self._rename(obs, info)
        return obs, reward, done, info

    def expert_action(self):
        return self._named(self.env.expert_action())

    def searching_action(self):
        return self._named(self.env.searching_action())


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------
def make_webshop_env(split="train", seed=0, backend="offline", results_names="asin", **options):
    """A WebShop env on goal `seed % webshop_num_tasks(split)` of the split's fixed goal list; with
    results_names="position", seen through PositionNamedResults."""
    check_options("WebShop", {"results_names": results_names}, WEBSHOP_OPTIONS)
    if backend == "real":
        unknown = set(options) - set(WEBSHOP_ENV_DEFAULTS) - {"num_products", "human_goals"}
        if unknown:
            raise ValueError(f"webshop: unknown option(s) {sorted(unknown)} for backend='real'")
        check_options("WebShop", options, WEBSHOP_OPTIONS)
        env = RealWebShopEnv(split=split, seed=seed, **options)
    elif backend != "offline":
        raise ValueError(f"webshop: unknown backend {backend!r}; use 'offline' or 'real'")
    else:
        catalog_options, env_options = _catalog_and_env_options(options)
        catalog = build_webshop_catalog(**catalog_options)
        start, end = _split_range(split, len(catalog.goals))
        env = WebShopEnv(catalog, catalog.goals[start + seed % (end - start)], **env_options)
    return PositionNamedResults(env) if results_names == "position" else env


@functools.lru_cache(maxsize=4)
def _vocabulary(num_products, goals_per_product, no_options_prob):
    catalog = _generate_catalog(num_products, goals_per_product, no_options_prob)
    texts = [render_search_page(""), render_results_page("", [], 2, SEARCH_RETURN_N), render_item_page(
        "", dict(options={}, Title="", Price="", Rating="N.A.")), "No reviews found",
        DONE_PAGE, " ".join(f"{x / 100:.2f}" for x in range(101)),
        " ".join(str(i) for i in range(SEARCH_RETURN_N + 1)), "click search",
        PREV_PAGE, NEXT_PAGE, BACK_TO_SEARCH, BUY_NOW, " ".join(SUB_PAGES)]
    for p in catalog.products:
        texts += [p["asin"], p["asin"].lower(), p["Title"], p["Price"], p["Description"]]
        texts += p["BulletPoints"] + [x for r in p["Reviews"] for x in (r["title"], r["body"])]
        texts += [str(r["score"]) for r in p["Reviews"]]
        texts += [g + " " + " ".join(vs) for g, vs in p["options"].items()]
    for goal in catalog.goals:
        texts += webshop_search_queries(goal)
    return sorted({w for t in texts for w in re.findall(r"\w+", t)})


def webshop_vocabulary(**options):
    """Every `\\w+` word (case as it appears) of any observation, instruction or listed action."""
    catalog_options, _ = _catalog_and_env_options(options)
    return list(_vocabulary(**catalog_options)) + (POSITION_NAMES if options.get("results_names") == "position" else [])


# ---------------------------------------------------------------------------------------------
# 12. Dispatch: make_env, num_tasks, vocabulary
# ---------------------------------------------------------------------------------------------

ENV_NAMES = ("alfworld", "webshop")
BACKENDS = ("offline", "real")
REAL_ONLY_OPTIONS = ("game_files", "human_goals")   # options only backend="real" takes


def _alfworld_options(options, backend="offline"):
    """The options merged with the defaults; a one-line ValueError for an unknown option, one that the
    backend does not take (ALFWORLD_BACKEND_OPTIONS) or a bad value (ALFWORLD_OPTIONS)."""
    unknown = set(options) - set(ALFWORLD_OPTIONS)
    if unknown:
        raise ValueError(f"unknown ALFWorld options {sorted(unknown)}")
    elsewhere = sorted(set(options) - set(ALFWORLD_BACKEND_OPTIONS[backend]))
    if elsewhere:
        other = next(b for b in BACKENDS if b != backend)
        raise ValueError(f"ALFWorld option(s) {elsewhere} need backend={other!r} (--backend {other})")
    check_options("ALFWorld", options, ALFWORLD_OPTIONS)
    opts = {**DEFAULTS, "task_types": TASK_TYPES, **options}
    opts["task_types"] = tuple(opts["task_types"])
    return opts


def _check_name_backend(name, backend):
    if name not in ENV_NAMES:
        raise ValueError(f"unknown environment {name!r}; expected one of {list(ENV_NAMES)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {list(BACKENDS)}")


def make_env(name, split="train", seed=0, backend="offline", **options):
    """An environment for task number `seed % num_tasks(name, split)` of the split's fixed task list.

    ALFWorld options (defaults): max_steps=50, task_types=all six, num_receptacles=6, num_distractors=2,
    grammar="move" ("put" = alfworld <= 0.3 text); backend="real" takes game_files (list or folder,
    default $ALFWORLD_DATA/json_2.1.1/<split>) and max_steps. A bad option is a one-line ValueError
    (ALFWORLD_OPTIONS, WEBSHOP_OPTIONS).
    """
    _check_name_backend(name, backend)
    if name == "webshop":
        return make_webshop_env(split=split, seed=seed, backend=backend, **options)
    _check_split(split)
    opts = _alfworld_options(options, backend)
    if backend == "real":
        return RealALFWorldEnv(opts["game_files"] if "game_files" in options else None, split=split,
                               seed=seed, max_steps=opts["max_steps"])
    layout = generate_layout(split, seed % SPLIT_SIZES[split], opts["task_types"], opts["num_receptacles"],
                             opts["num_distractors"])
    return ALFWorldEnv.from_layout(layout, max_steps=opts["max_steps"], grammar=opts["grammar"])


def num_tasks(name, split, **options):
    """Size of a split's fixed task list (for ALFWorld backend="real": the number of game files)."""
    backend = options.pop("backend", "offline")
    _check_name_backend(name, backend)
    if name == "webshop":
        return webshop_num_tasks(split, **options)
    _check_split(split)
    _alfworld_options(options, backend)
    if backend == "real":
        return len(_find_game_files(options.get("game_files"), split))
    return SPLIT_SIZES[split]


def vocabulary(name, **options):
    """Sorted list of every word (regex \\w+) that can appear in an offline observation, task or action.

    backend="real" gives the same offline list (the options only the real engines take are dropped):
    the real engines' text is open-ended (the official ALFWorld games also use e.g. knife, sliced).
    """
    backend = options.pop("backend", "offline")
    _check_name_backend(name, backend)
    if backend == "real":
        options = {k: v for k, v in options.items() if k not in REAL_ONLY_OPTIONS}
    if name == "webshop":
        return webshop_vocabulary(**options)
    opts = _alfworld_options(options)
    texts = list(MESSAGES.values()) + [HELP_TEXT, HELP_TEXT_PUT] + [p.pattern for p in COMMANDS.values()]
    texts += [t for pair in GOAL_TEMPLATES.values() for t in pair]
    words = {w for t in texts for w in re.findall(r"\w+", re.sub(r"\{\w+\}|\(\?P<\w+>", " ", t))}
    words |= set(CAN_CONTAIN) | set(ALFRED_TYPES) - {"knife", "butterknife"}
    most_instances = opts["num_receptacles"] + opts["num_distractors"] + 2
    words |= {str(i) for i in range(1, most_instances + 1)}
    return sorted(words)
