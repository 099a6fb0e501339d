"""Every number and word list the probes judge by, in one place, each with the reason for it.

A probe that cries wolf is worse than none, so each threshold is set where a finding is clearly true on a busy 2-core
machine, not where it might be: quadratic against linear, not 1.3 against 1.1.
"""

import re

# --- the whole probe pass -------------------------------------------------------------------------------------------
# The probes run inside the smoke persona's time; this is the most they may take of it, whatever the project's size,
# so a review never waits on them (each script also has its own timeout below).
PROBES_BUDGET_S = 240.0

# --- claims against measurements (timing_claims.py) -----------------------------------------------------------------
# `import pkg` over half a second: every script, CLI call and test run pays it. A pure-Python library imports in
# 5-50 ms; numpy in ~100 ms; half a second means heavy work at import time (the figure).
IMPORT_SLOW_MS = 500.0
IMPORT_REPEATS = 5  # as reviewer/persona/smoke.py measures it: median of 5 after one warm-up run that writes the .pyc files
# `tool --help` over a second: a user at the prompt notices. Python starts in ~20 ms and argparse/click CLIs answer
# --help in 50-300 ms, so over a second means the CLI imports far more than it needs to print its help.
CLI_START_SLOW_S = 1.0
CLI_REPEATS = 3
# Test-suite time has no threshold: suites differ in size by orders of magnitude, and a number with nothing claimed
# about it is not a defect.
# Words that make a slow import worse: the docs promised otherwise. Quoted in the finding so a reader can judge.
SPEED_CLAIM = re.compile(r"\b(light-?weight|lightning|blazing(ly)?|instant(ly|aneous)?|fast|speedy|snappy|"
                         r"quick to (import|load|start)|minimal overhead|zero overhead|low overhead)\b", re.IGNORECASE)

# --- scaling (scaling.py) -------------------------------------------------------------------------------------------
# A sentence that names a function and says one of these is a claim that the function scales well.
LINEAR_CLAIM = re.compile(r"\b(linear(ly)?|O\(n\)|constant time|O\(1\)|scales?( well)?|millions|fast|efficient(ly)?|"
                          r"performant|cheap)\b", re.IGNORECASE)
# The growth exponent b (time ~ n^b) is compared with the output's own growth: a function whose output grows as n^2
# (all windows of all sizes, a product) must take n^2. The excess is b - max(1, output exponent).
# n log n fits as ~1.05-1.15 over the sizes used here and machine noise moves b by ~0.1-0.2, so:
EXCESS_CLAIMED = 0.4  # docs say linear or fast: anything from ~n^1.4 on contradicts them
EXCESS_UNCLAIMED = 0.8  # nothing claimed: only clearly quadratic or worse is worth saying
SCALING_START = 256  # elements of the largest sequence argument at the first size
SCALING_MAX = 2**18  # ... and at most: 10 doublings, enough for a linear function to reach milliseconds
SCALING_ENOUGH_S = 0.05  # stop doubling once one call takes this long: the top points are then far above timer noise
SCALING_CALL_LIMIT_S = 2.0  # one call longer than this ends the growth (an exponential function must not hang us)
SCALING_POINTS = 4  # the fit uses the largest 4 sizes (a factor of 8), where constant overheads matter least
SCALING_REPEATS = 5  # per size; the medians (and the minima) are fitted, as reviewer/stats.py would summarize them
SCALING_BATCH_S = 0.005  # tiny calls are looped until one repeat takes this long (timeit's autorange, smaller)
SCALING_SCRIPT_BUDGET_S = 6.0  # one function's whole measurement, inside its script (all its variants)
SCALING_SCRIPT_TIMEOUT = 25.0  # the sandbox kills the script past this, whatever it does (C code ignores the alarm)
SCALING_MAX_FUNCTIONS = 20  # one call site each; claimed functions first, then those the docs call, then the tests'
OUTPUT_CAP = 2**22  # items taken from a returned iterator: infinite ones are cut here (and not fitted)

# --- edge inputs (edge_inputs.py) -----------------------------------------------------------------------------------
# Exceptions that say "the code did not expect this input" rather than "you gave me bad input": an unhelpful crash.
# ValueError and TypeError are how Python code rejects bad input, so they are never findings here.
CRASHES = ("IndexError", "KeyError", "ZeroDivisionError", "AttributeError", "RecursionError", "UnboundLocalError")
NON_ASCII = "Ünïcödé ✓ 日本語"
# A docstring or doc sentence saying the input must be non-empty / positive makes empty / zero / negative inputs out
# of contract: whatever they raise is then the caller's problem, not a finding.
NON_EMPTY_CONTRACT = re.compile(r"non-?empty|not be empty|must not be empty|at least one|cannot be empty", re.I)
POSITIVE_CONTRACT = re.compile(r"positive|> ?0\b|>= ?1\b|non-?negative|greater than (zero|0)|at least 1\b", re.I)
# A function that returns an element of its sequence ("The last element in a sequence", toolz.last; `nth`) has no
# element to return from an empty one: its IndexError there is Python's own contract (as `[][0]`), not a crash.
ELEMENT_CONTRACT = re.compile(r"\b(element|item|entry|member)s? (of|in|from)\b", re.I)
# A function that says it divides ("Divide two numbers.", pydash.divide) raising ZeroDivisionError for a zero we passed
# keeps Python's own contract for `/`, as `20 / 0` does; elsewhere (a percentile at 0) it is still a crash.
DIVISION_CONTRACT = re.compile(r"\bdivi(de|des|ded|ding|sion|sor)\b|\bquotient\b", re.I)
# Several sequences that must fit together (matrices, parallel lists): emptying one of them breaks the fit, which the
# caller must keep. They are emptied only all at once, and not at all where the docstring says they must fit.
FIT_CONTRACT = re.compile(r"compatib|same length|equal length|lengths? must|must match|same size|same shape", re.I)
EDGE_CALL_LIMIT_S = 2.0  # one edge call; longer is abandoned (not reported: a hang is not a crash)
EDGE_SCRIPT_TIMEOUT = 20.0  # C code (an itertools chain) ignores the per-call alarm; the sandbox stops it here
EDGE_MAX_FUNCTIONS = 60
CLI_EDGE_TIMEOUT_S = 20.0  # one CLI run on an edge input

# --- docs as executable claims (docs_claims.py) ---------------------------------------------------------------------
DOCS_SCRIPT_TIMEOUT = 120.0  # all python examples of one doc file, run in order
DOC_COMMAND_TIMEOUT_S = 30.0  # one documented command
MAX_DOC_FILES = 20
MAX_DOC_BYTES = 300_000
# Files that describe the past (or how to contribute), not what the code does now.
NOT_DOCS = re.compile(r"change|history|news|release|version|contribut|code.of.conduct|authors|license|security",
                      re.I)

# --- collections against their models (models.py) ---------------------------------------------------------------------
MODEL_MAX_CLASSES = 5  # collection classes driven per review
MODEL_TRIALS = 200  # random sequences per class and mode (behaviour, promised exceptions)
MODEL_SEQUENCE_LENGTH = 25  # operations per sequence: long enough to pop what was added and use it again
MODEL_SEARCH_S = 5.0  # per class and mode; a stale index shows within the first few sequences
MODEL_SCRIPT_TIMEOUT = 40.0  # both modes and the shrinking; every call also has a one-second alarm
