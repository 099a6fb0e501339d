"""The probes' sandbox side: the code their check scripts run inside the sandbox, with the project's own Python.

A check script (reviewer.persona.probes.runner.script) carries the modules of this package it needs, writes them to a
fresh temporary folder (outside the clone: they can neither shadow nor dirty the project), appends that folder to
sys.path under the name `reviewer_probes_sandboxed`, and calls one function. So each module is real Python, linted and
imported like the rest, and each finding's repro command still stands alone in a fresh clone.

The rule (tests/reviewer/test_import_graph.py enforces it): the standard library and this package (relative imports)
only; nothing of `reviewer`, which is not installed in the sandbox. Python 3.8+.
"""
