"""Where the test suite's time goes, file by file: wall time, and JAX's tracing, lowering and compiling.

    python -m benchmarks.suite_profile            # warm: the suite's persistent compilation cache as it is
    python -m benchmarks.suite_profile --fresh    # empty caches: TMPDIR (and so the suite's XLA cache) a new folder

Runs the README's test command (`python -m pytest`, two workers) with `--durations=0` and this module loaded as a
pytest plugin in each worker: it listens to JAX's monitoring events and adds up, per test file, the seconds spent
tracing (jaxpr_trace_duration), lowering to StableHLO (jaxpr_to_mlir_module_duration) and in the backend compile
(backend_compile_duration: an XLA compile, or a load from the persistent cache, which cache_hits counts). Times on
the compile threads are summed, so a file's compile seconds can exceed its wall time. Prints the run's total and the
slowest files.

    python -m benchmarks.suite_profile --fresh --programs   # also: which compiled programs repeat across files

With --programs the plugin also records every backend compile's module name, parameter types and a digest of its
StableHLO (without locations), and the report lists, per module name, the distinct programs and the files that
compiled each: the programs that differ only in a shape one test picked are where sharing an engine would pay.
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

STATS_DIR_ENV = "JAXSERVE_SUITE_PROFILE_DIR"  # where each worker writes its counts
PROGRAMS_ENV = "JAXSERVE_SUITE_PROFILE_PROGRAMS"  # "1": record each compiled program's signature too
EVENTS = ("backend_compile_duration", "jaxpr_trace_duration", "jaxpr_to_mlir_module_duration")

_counts: collections.defaultdict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_current_file = ["(collection)"]
_lock = threading.Lock()
_programs: list[dict] = []  # one per backend compile: file, module, parameters, digest, seconds


def program_signature(module) -> tuple[str, str, str]:
    """A StableHLO module's name, its main function's type, and a digest of its text without locations."""
    name = str(module.operation.attributes["sym_name"]).strip('"')
    main = next(op for op in module.body.operations if str(op.attributes["sym_name"]).strip('"') == "main")
    text = module.operation.get_asm(enable_debug_info=False)
    return name, str(main.attributes["function_type"]), hashlib.sha1(text.encode()).hexdigest()[:16]


def _record_programs() -> None:
    """Wrap JAX's compile-or-load so each compiled program's signature is recorded against the current file; once
    (a second call, as this module's own test makes inside a profiled run, would record each program twice)."""
    from jax._src import compiler

    compile_or_get_cached = compiler.compile_or_get_cached
    if getattr(compile_or_get_cached, "records_programs", False):
        return

    def recording(backend, computation, *args, **kwargs):
        start = time.perf_counter()
        executable = compile_or_get_cached(backend, computation, *args, **kwargs)
        name, function_type, digest = program_signature(computation)
        with _lock:
            _programs.append({"file": _current_file[0], "module": name, "type": function_type, "digest": digest,
                              "seconds": time.perf_counter() - start})
        return executable

    recording.records_programs = True
    compiler.compile_or_get_cached = recording


def _on_duration(event: str, duration: float, **kwargs) -> None:
    name = event.rsplit("/", 1)[-1]
    if name in EVENTS:
        with _lock:
            _counts[_current_file[0]][name] += duration
            _counts[_current_file[0]][name + ":count"] += 1


def _on_event(event: str, **kwargs) -> None:
    if event.endswith("/cache_hits"):
        with _lock:
            _counts[_current_file[0]]["cache_hits"] += 1


def pytest_configure(config) -> None:
    """(pytest plugin) Listen to JAX's events in this worker."""
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)
    if os.environ.get(PROGRAMS_ENV) == "1":
        _record_programs()


def pytest_runtest_protocol(item, nextitem) -> None:
    """(pytest plugin) Count what follows against this test's file."""
    _current_file[0] = item.path.name


def pytest_sessionfinish(session) -> None:
    """(pytest plugin) Write this worker's counts."""
    folder = os.environ.get(STATS_DIR_ENV)
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump({name: dict(counts) for name, counts in _counts.items()}, f)
        if _programs:
            with open(os.path.join(folder, f"programs-{os.getpid()}.jsonl"), "w") as f:
                f.writelines(json.dumps(program) + "\n" for program in _programs)


def file_durations(output: str) -> collections.Counter:
    """Seconds per test file (setup, call and teardown) from pytest's --durations=0 report."""
    seconds: collections.Counter = collections.Counter()
    for match in re.finditer(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+tests/([\w.]+\.py)", output, re.MULTILINE):
        seconds[match.group(2)] += float(match.group(1))
    return seconds


def repeated_programs(programs: list[dict], top: int) -> str:
    """Per module name: compiles, distinct programs, their seconds, and the files behind its most-compiled programs."""
    by_module: collections.defaultdict[str, list[dict]] = collections.defaultdict(list)
    for program in programs:
        by_module[program["module"]].append(program)
    lines = ["| module | compiles | distinct | seconds | distinct parameter types | files |",
             "|---|---|---|---|---|---|"]
    ranked = sorted(by_module.items(), key=lambda item: -sum(p["seconds"] for p in item[1]))
    for module, compiled in ranked[:top]:
        files = collections.Counter(p["file"] for p in compiled)
        lines.append(f"| {module} | {len(compiled)} | {len({p['digest'] for p in compiled})} "
                     f"| {sum(p['seconds'] for p in compiled):.0f} | {len({p['type'] for p in compiled})} "
                     f"| {', '.join(f'{f} {n}' for f, n in files.most_common(6))} |")
    return "\n".join(lines)


def main() -> None:
    """Run the suite once and print the per-file table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fresh", action="store_true", help="empty caches (a new TMPDIR)")
    parser.add_argument("--top", type=int, default=25, help="files to list (default 25)")
    parser.add_argument("--programs", action="store_true",
                        help="record each compiled program and list the modules compiled most")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, STATS_DIR_ENV: scratch}  # (no PYTHONPATH: the wheel test installs jaxserve anew)
        if args.programs:
            env[PROGRAMS_ENV] = "1"
        if args.fresh:
            env["TMPDIR"] = os.path.join(scratch, "tmp")
            os.mkdir(env["TMPDIR"])
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "benchmarks.suite_profile", "--durations=0"],
                              cwd=root, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        counts: collections.defaultdict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for path in glob.glob(os.path.join(scratch, "*.json")):
            with open(path) as f:
                for name, values in json.load(f).items():
                    counts[name].update(values)
        programs = [json.loads(line) for path in glob.glob(os.path.join(scratch, "programs-*.jsonl"))
                    for line in open(path)]
    if done.returncode:
        print(done.stdout[-6000:] + done.stderr[-2000:])
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed).* in .*?)=*$", done.stdout, re.MULTILINE)
    print(f"{'fresh' if args.fresh else 'warm'}: {summary[-1] if summary else 'no summary'}; wall {wall:.0f} s, "
          f"exit status {done.returncode}")
    seconds = file_durations(done.stdout)
    total = collections.Counter()
    for values in counts.values():
        total.update(values)
    print(f"test time {sum(seconds.values()):.0f} s; trace {total['jaxpr_trace_duration']:.0f} s, lower "
          f"{total['jaxpr_to_mlir_module_duration']:.0f} s, compile or load {total['backend_compile_duration']:.0f} s "
          f"({total['backend_compile_duration:count']:.0f} executables, {total['cache_hits']:.0f} from the cache)")
    print("| file | s | trace s | lower s | compile s | executables | cache hits |\n|---|---|---|---|---|---|---|")
    for name, spent in seconds.most_common(args.top):
        c = counts.get(name, collections.Counter())
        print(f"| {name} | {spent:.1f} | {c['jaxpr_trace_duration']:.1f} | {c['jaxpr_to_mlir_module_duration']:.1f} "
              f"| {c['backend_compile_duration']:.1f} | {c['backend_compile_duration:count']:.0f} "
              f"| {c['cache_hits']:.0f} |")
    if programs:
        path = os.path.join(tempfile.gettempdir(), "jaxserve-suite-programs.jsonl")
        with open(path, "w") as f:
            f.writelines(json.dumps(program) + "\n" for program in programs)
        print(f"\n{len(programs)} programs compiled or loaded, {len({p['digest'] for p in programs})} distinct "
              f"(each in {path})\n" + repeated_programs(programs, args.top))
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
