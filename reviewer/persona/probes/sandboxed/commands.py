"""The docs' command lines run inside the sandbox: each console script's `--help`, and a documented command's
subcommand, flags and output (the host half: reviewer/persona/probes/docs_claims.py)."""

from __future__ import annotations

import doctest
import re
import subprocess

from .prelude import emit

# What a command prints when it needs the network the sandbox does not give
OFFLINE = re.compile(r"Name or service not known|Temporary failure in name resolution|Network is unreachable|"
                     r"Connection refused|Could not resolve host|Max retries exceeded|ProxyError|SSLError")


def run_cli(args, timeout, shell=False):
    """(exit code or None on timeout, stdout, stderr) of a command, stdin closed."""
    try:
        p = subprocess.run(args, shell=shell, executable="/bin/bash" if shell else None, capture_output=True,
                           text=True, errors="replace", timeout=timeout, stdin=subprocess.DEVNULL)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        return None, str(e.stdout or ""), str(e.stderr or "")
    except OSError as e:
        return 127, "", str(e)


def check_command(cmd, checks, timeout):
    """The problems of one documented command line: a rejected subcommand, a rejected flag, and (when it can run as
    written) a traceback, a failure or output other than the docs show."""
    argv, k = cmd["argv"], cmd["prefix"]
    problems = []
    helps = [run_cli(argv[:k] + ["--help"], timeout)[1]]
    word = argv[k] if len(argv) > k and not argv[k].startswith("-") else None
    if word and "subcommand" in checks:
        code, out, err = run_cli(argv[:k + 1] + ["--help"], timeout)
        pattern = r"(no such command|invalid choice|unknown command|unrecognized command)[^\n]*" + re.escape(word)
        if code not in (0, None) and re.search(pattern, out + err, re.I):
            problems.append({"check": "subcommand", "word": word, "output": (out + err)[-1500:]})
        elif code == 0:
            helps.append(out)
    for token in argv[k:] if "flags" in checks else []:
        flag = token.split("=")[0]
        if not flag.startswith("--") or flag == "--" or any(
                re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", h) for h in helps):
            continue
        code, out, err = run_cli(argv, timeout)
        unknown = r"(unrecognized arguments?|no such option|unknown option|invalid option|unexpected argument)"
        if code not in (0, None) and re.search(unknown + r"[^\n]*" + re.escape(flag), out + err, re.I):
            problems.append({"check": "flags", "flag": flag, "output": (out + err)[-1500:]})
    if "run" in checks:
        code, out, err = run_cli(cmd["text"], timeout, shell=True)
        offline = OFFLINE.search(out + err)
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        shown = cmd.get("expected")
        if shown and any(doctest.OutputChecker().check_output(shown + "\n", text, flags) for text in (out, err, out + err)):
            return problems  # what the docs show, an error message and a failing exit code included
        if "Traceback (most recent call last)" in out + err:
            problems.append({"check": "run", "what": "traceback", "output": (out + err)[-1500:]})
        elif code is None or offline:
            pass  # too slow to judge, or it needs the network the sandbox does not give
        elif code != 0:
            problems.append({"check": "run", "what": f"exit code {code}", "output": (out + err)[-1500:]})
        elif shown:
            again = run_cli(cmd["text"], timeout, shell=True)[1]
            if again == out:  # the same both times: not a clock, a random value or an id
                problems.append({"check": "run", "what": "output", "output": out[-1500:]})
    return problems


def check(cmd, checks, timeout):
    """The check script's entry for one documented command: exit 1 when it has a problem."""
    problems = check_command(cmd, checks, timeout)
    emit({"problems": problems})
    return 1 if problems else 0


def check_help(scripts, timeout):
    """Each console script's `--help` must answer without a traceback: exit 1 when one does not."""
    problems = []
    for name in scripts:
        code, out, err = run_cli([name, "--help"], timeout)
        if code is None or "Traceback (most recent call last)" in out + err or (
                code != 0 and "usage" not in (out + err).lower()):
            problems.append({"script": name, "code": code, "output": (out + err)[-1500:]})
    emit({"problems": problems})
    return 1 if problems else 0
