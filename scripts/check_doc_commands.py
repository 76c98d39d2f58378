#!/usr/bin/env python3
"""Runs every command shown in the documentation, so none of them can rot.

Usage: scripts/check_doc_commands.py [--update] BUILD_DIR [DOC ...]
       (default: README.md and docs/**/*.md)

A command is a line of a ```sh block that starts with ./build/bin/kvlab, kvlab or
python3 experiments/. Each distinct command runs once, in document order, from a scratch
folder that links build/, data/, experiments/, profiles/ and tests/ of this checkout (results/ and
models/ land there, not in the checkout). It must exit 0. Where the command is pure arithmetic
and the page shows what it printed (the next ```text block, or the markdown table rows after
it), every shown line must appear in the output: those pages cannot drift from the code or from
the shipped hardware profiles. Pure arithmetic: kvlab memory, kvlab cost, a run on the simulated
backend, and
a kvlab run of an experiment on the virtual or offline clock (each step priced by a profile)
whose preset model runs a synthetic workload (lengths from the workload, not from the tokens a
machine's kernels happen to produce), no clock in a sweep, and no arguments but --out and
--set changes that leave the clock and the model alone. A page's table may follow its run after
prose and a ```sh block of `kvlab view` commands ("watch it step by step").

--update rewrites what such a page shows instead of failing: each shown table row whose first
cell names a row the command printed becomes that row, and a ```text block becomes the output
(after a profile or the cost model changes; the prose around them is for a person to reread).

Shown but not run, with the reason printed: the README's ./scripts/*.sh (they are the CI job
itself), the install-and-build lines of docs/writing-a-plugin.md (ctest's
install.find_package_consumer runs exactly those steps), and benchmark binaries, which run
with --benchmark_list_tests=true (flags and filters are checked; measuring is for humans).
"""
import os
import pathlib
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def blocks(path):
    """Yields (language, first line number, lines) of every fenced block."""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start, body = lines[i][3:].strip(), i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            yield lang, start + 1, body, i + 1
        i += 1


def view_block_end(lines, i):
    """The line after a ```sh block at `i` that only runs `kvlab view` (a page's "watch it step
    by step" between a run and its table), or None."""
    if lines[i].strip() not in ("```sh", "```bash"):
        return None
    end = i + 1
    while end < len(lines) and not lines[end].startswith("```"):
        if lines[end].strip() and not lines[end].strip().startswith("./build/bin/kvlab view "):
            return None
        end += 1
    return end + 1


def shown_start(lines, after_line):
    """Where the ```text block or table shown for the command ending at `after_line` starts
    (past prose and `kvlab view` blocks), or None."""
    i = after_line
    while i < len(lines) and not lines[i].startswith("|"):
        if lines[i].startswith("```"):
            skip = view_block_end(lines, i)
            if skip is None:
                return i if lines[i].strip() == "```text" else None
            i = skip
            continue
        if lines[i].startswith("#") or "./build/bin/" in lines[i]:
            return None
        i += 1
    return i if i < len(lines) else None


def shown_output(path, after_line):
    """The ```text block or markdown table rows that follow line `after_line`."""
    lines = path.read_text().splitlines()
    i = shown_start(lines, after_line)
    if i is None:
        return []
    if lines[i].startswith("|"):
        rows = []
        while i < len(lines) and lines[i].startswith("|"):
            if not lines[i].startswith("|---") and not lines[i].startswith("| run |"):
                rows.append(lines[i])
            i += 1
        return rows
    if lines[i].strip() == "```text":
        rows = []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            rows.append(lines[i].rstrip())
            i += 1
        return rows
    return []


def update_shown(path, after_line, output):
    """Rewrites the table rows or ```text block after line `after_line` (shown_output's) with the
    command's `output` lines; returns how many lines changed."""
    lines = path.read_text().splitlines()
    i = shown_start(lines, after_line)
    if i is None:
        return 0
    changed = 0
    if i < len(lines) and lines[i].startswith("|"):
        printed = {row.split("|")[1].strip(): row for row in output
                   if row.startswith("|") and not row.startswith("|---")}
        while i < len(lines) and lines[i].startswith("|"):
            key = lines[i].split("|")[1].strip()
            row = printed.get(key)
            if row is not None and row != lines[i] and row.count("|") == lines[i].count("|"):
                lines[i] = row
                changed += 1
            i += 1
    elif i < len(lines) and lines[i].strip() == "```text":
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        new = [row.rstrip() for row in output
               if not row.startswith("results:") and not row.startswith("step by step")]
        while new and not new[-1].strip():
            new.pop()
        shown = lines[i + 1:end]
        if len(new) != len(shown):  # the page shows an excerpt: which lines, a person decides
            print(f"excerpt  {path.relative_to(ROOT)}:{i + 1}: shows {len(shown)} of "
                  f"{len(new)} lines; update it by hand")
            return 0
        if new != shown:
            changed = sum(1 for a, b in zip(new, shown) if a != b)
            lines[i + 1:end] = new
    if changed:
        path.write_text("\n".join(lines) + "\n")
    return changed


def priced_run(line):
    """True for a kvlab run whose table is arithmetic (see the module's docstring): its own
    experiment file, or with --set changes that leave the clock and the model alone, and --out."""
    words = shlex.split(line)
    if words[:2] != ["./build/bin/kvlab", "run"] or len(words) < 3:
        return False
    if not re.fullmatch(r"experiments/[\w.-]+\.toml", words[2]):
        return False
    rest = words[3:]
    while rest:
        if len(rest) < 2 or rest[0] not in ("--set", "--out"):
            return False
        if rest[0] == "--set" and rest[1].split("=")[0] in ("experiment.clock", "model.name"):
            return False
        rest = rest[2:]
    with open(ROOT / words[2], "rb") as f:
        config = tomllib.load(f)
    clock = config.get("experiment", {}).get("clock", "virtual")
    swept = {sweep.get("key") for sweep in config.get("sweep", [])}
    model = config.get("model", {}).get("name", "")
    return (clock in ("virtual", "offline") and "experiment.clock" not in swept
            and "/" not in model and "prompts" not in config.get("workload", {}))


def commands(docs):
    for path in docs:
        for lang, first, body, end in blocks(path):
            if lang not in ("sh", "bash"):
                continue
            for offset, raw in enumerate(body):
                line = re.sub(r"\s+#.*$", "", raw).strip()
                if not line or line.startswith("#"):
                    continue
                yield path, first + offset, line, end


def main():
    args = sys.argv[1:]
    update = bool(args) and args[0] == "--update"
    args = args[1:] if update else args
    if not args:
        sys.exit(__doc__)
    build = pathlib.Path(args[0]).resolve()
    docs = [pathlib.Path(p).resolve() for p in args[1:]] or (
        [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md")))
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="kvlab_doc_commands_"))
    os.symlink(build, scratch / "build")
    for name in ("data", "experiments", "profiles", "tests"):
        os.symlink(ROOT / name, scratch / name)
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    seen, failures, ran, skipped, updates = set(), [], 0, 0, []
    for path, line_no, line, block_end in commands(docs):
        where = f"{path.relative_to(ROOT)}:{line_no}"
        if line.startswith("./scripts/") or line.startswith("cmake ") or line.startswith("/opt/"):
            print(f"skip  {where}: {line}  (covered by CI / install.find_package_consumer)")
            skipped += 1
            continue
        if line.startswith("kvlab "):
            line = "./build/bin/" + line
        if line.startswith("./build/bin/kvlab_bench"):
            line += " --benchmark_list_tests=true"
        elif not (line.startswith("./build/bin/kvlab ") or line.startswith("python3 experiments/")):
            failures.append(f"{where}: not a runnable command: {line}")
            continue
        if line in seen:
            continue
        seen.add(line)
        if line.startswith("python3 "):  # the interpreter running this check (Debian's, with
            line = sys.executable + line[len("python3"):]  # matplotlib), not a PATH shadow
        started = time.monotonic()
        result = subprocess.run(line, shell=True, cwd=scratch, env=env, capture_output=True,
                                text=True, timeout=900)
        ran += 1
        seconds = time.monotonic() - started
        print(f"{'ok' if result.returncode == 0 else 'FAIL':4}  {where}: {line}  ({seconds:.1f} s)",
              flush=True)
        if result.returncode != 0:
            failures.append(f"{where}: exit {result.returncode}: {line}\n{result.stderr[-2000:]}")
            continue
        # (kvlab view prints only its page's path, whatever results folder it names)
        deterministic = " view " not in line and (
            " memory " in line or " cost " in line or "simulated" in line or priced_run(line))
        if deterministic:
            output = result.stdout.splitlines()
            for shown in shown_output(path, block_end):
                if shown.strip() and shown not in output:
                    if update:  # applied below, last block first: line numbers stay right
                        updates.append((path, block_end, output, where))
                    else:
                        failures.append(f"{where}: the page shows a line the command no longer "
                                        f"prints:\n  {shown}\n--- it printed:\n{result.stdout}")
                    break
    for path, block_end, output, where in sorted(updates, key=lambda u: (str(u[0]), -u[1])):
        print(f"updated {where}: {update_shown(path, block_end, output)} lines")
    print(f"\n{ran} commands ran, {skipped} skipped, {len(failures)} failed")
    for f in failures:
        print(f"\nFAILED {f}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
