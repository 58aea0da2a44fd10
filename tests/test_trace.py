"""The run's timeline (dataplane_rl/trace.py): spans, the bounds, the file a kill leaves, and a run's trace.json.

A whole run's trace is checked by `assert_run_trace`, on runs other tests already make (test_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataplane_rl import trace
from dataplane_rl.trace import TraceFile, Tracer, read_trace

# the phases every step of a GRPO run shows, per kind of process (driver/step.py, rollout/ and train/worker.py)
DRIVER_PHASES = {"step", "collect_groups", "wait_for_rollouts", "advantages", "logprobs", "train", "refit", "train_data"}
ROLLOUT_PHASES = {"rollout_job", "generate", "load_weights"}
RANK_PHASES = {"logprobs", "train", "forward_backward"}
# a rank's part of a refit: the weights written into shared memory (rollout actors on its node) or gathered for the
# object store (elsewhere, vLLM, in-flight updates; and the policy export)
REFIT_PHASES = {"publish_weights", "gather_weights"}


def names_by_process(events: list[dict]) -> dict[str, set[str]]:
    """process name -> the names of its complete events."""
    roles = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    out: dict[str, set[str]] = {r: set() for r in roles.values()}
    for e in events:
        if e["ph"] == "X":
            out[roles[e["pid"]]].add(e["name"])
    return out


def assert_run_trace(run_dir: Path, roles: list[str], steps: list[int], data_plane: bool = True,
                     checkpoints: bool = False, sync: bool = True) -> dict:  # checkpoints: a run that saved some
    """RUN_DIR/trace.json of a finished run: it parses as JSON, every process is named, each step's phases
    are there (a step run twice, killed and resumed, counts once), every event lies within the run and each
    process's events nest; sync: each step's generation and training inside its span. Returns the file."""
    doc = json.loads((run_dir / "trace.json").read_text())  # plain JSON, no tolerant reader needed
    events = doc["traceEvents"]
    by = names_by_process(events)
    assert set(roles) <= set(by), f"unnamed processes: {set(roles) - set(by)}"
    assert DRIVER_PHASES <= by["driver"], DRIVER_PHASES - by["driver"]
    for role in roles:
        want = set(ROLLOUT_PHASES if role.startswith("rollout") else RANK_PHASES if role.startswith("train") else ())
        want |= ({"put"} if role.startswith("rollout") else {"get"} if role.startswith("train") else set()) if data_plane else set()
        want |= {"save_checkpoint"} if checkpoints and role.startswith("train") else set()
        assert want <= by[role], f"{role} lacks {want - by[role]}"
        if role.startswith("train"):
            assert REFIT_PHASES & by[role], f"{role} has no refit phase ({' or '.join(sorted(REFIT_PHASES))})"
    if checkpoints:
        assert "checkpoint" in by["driver"]
    timed = [e for e in events if e["ph"] == "X"]
    step_spans = [e for e in timed if e["name"] == "step"]
    assert sorted({e["args"]["step"] for e in step_spans}) == steps
    # one clock: every event of every process lies between the run's first and last driver event
    driver_pid = next(e["pid"] for e in events if e["ph"] == "M" and e["args"].get("name") == "driver")
    driver = [e for e in timed if e["pid"] == driver_pid]
    lo, hi = min(e["ts"] for e in driver), max(e["ts"] + e["dur"] for e in driver)
    for e in timed:
        assert e["dur"] >= 0 and lo <= e["ts"] and e["ts"] + e["dur"] <= hi, e
    # every phase of a step, the rollout actors' and the ranks' too, happens inside its driver span (sync GRPO)
    for s in step_spans if sync else ():
        inside = [e for e in timed if s["ts"] <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"]]
        assert DRIVER_PHASES | {"generate", "forward_backward"} <= {e["name"] for e in inside}, s
    for pid in {e["pid"] for e in timed}:  # complete events of one thread nest: a viewer draws them as a stack
        open_ends: list[int] = []
        for e in sorted((e for e in timed if e["pid"] == pid), key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1], f"overlapping spans: {e}"
            open_ends.append(e["ts"] + e["dur"])
    assert doc["otherData"]["dropped_events"] == 0
    return doc


def test_spans_nest_on_the_wall_clock_and_off_records_nothing():
    t = Tracer()
    with t.span("off"):
        pass
    assert t.take() == [] and t.events == []
    t.configure(True, "driver", ["driver", "rollout-0"])
    # the process's clock: the wall clock read once, then perf_counter (a wall-clock step since, such as CI's VM
    # clock sync of 18.7 s, moves time.time_ns but not the spans); microseconds since the epoch all the same
    before = trace.now_us()
    assert abs(before - time.time_ns() // 1000) < 3600e6
    with t.span("outer", step=3):
        with t.span("inner") as args:
            args["bytes"] = 12
    after = trace.now_us()
    events = t.take()
    names = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert names == {"driver": 1, "rollout-0": 10_001}  # fixed by role: a resumed run of another shape agrees
    inner, outer = [e for e in events if e["ph"] == "X"]  # recorded at exit: the inner one first
    assert (outer["name"], outer["args"], inner["args"]) == ("outer", {"step": 3}, {"bytes": 12})
    assert before - 1000 <= outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    assert outer["ts"] + outer["dur"] <= after + 1000  # microseconds since the epoch, within a millisecond
    assert {"process_name", "process_sort_index", "process_labels"} <= {e["name"] for e in events if e["ph"] == "M"}
    assert t.take() == []  # taken once


def test_actor_events_take_the_role_the_driver_gives_them():
    actor, driver = Tracer(), Tracer()
    actor.configure(True)
    driver.configure(True, "driver", ["driver", "rollout-0", "rollout-1"])
    driver.take()
    t0 = time.perf_counter()
    actor.complete("generate", t0, rows=4)
    driver.absorb(actor.take(), "rollout-1")
    driver.absorb(actor.take(), "rollout-1")  # nothing new: nothing added
    events = driver.take()
    assert [e["name"] for e in events] == ["process_labels", "generate"]
    assert {e["pid"] for e in events} == {10_002} and events[1]["args"] == {"rows": 4}
    driver.absorb([{"name": "x", "ph": "X", "ts": 1, "dur": 0}], "train-rank-0")  # a role not announced
    driver.absorb([{"name": "x", "ph": "X", "ts": 1, "dur": 0}], "teacher-0")
    assert {e["args"]["name"]: e["pid"] for e in driver.take() if e["name"] == "process_name"} == \
        {"train-rank-0": 20_001, "teacher-0": 30_005}


def test_the_buffer_is_bounded_and_counts_what_it_drops():
    t = Tracer()
    t.configure(True, cap=10)
    for _ in range(25):
        with t.span("s"):
            pass
    events = t.take()
    assert len([e for e in events if e["ph"] == "X"]) == 10
    assert events[-1]["ph"] == "C" and events[-1]["args"] == {"events": 15}


def _events(n: int, pid: int = 1) -> list[dict]:
    return [{"name": f"e{i}", "ph": "X", "ts": i, "dur": 1, "pid": pid, "tid": 1, "args": {}} for i in range(n)]


def test_the_file_parses_after_every_write_and_keeps_its_first_events(tmp_path):
    path = tmp_path / "trace.json"
    f = TraceFile(path, max_events=5)
    assert json.loads(path.read_text())["traceEvents"] == []
    meta = {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "driver"}}
    f.write([meta, *_events(3)])
    assert [e["name"] for e in json.loads(path.read_text())["traceEvents"]] == ["process_name", "e0", "e1", "e2"]
    f.write(_events(4))
    f.close([dict(meta, pid=2)])  # metadata past the cap still goes in
    doc = json.loads(path.read_text())
    assert [e["name"] for e in doc["traceEvents"]] == ["process_name", "e0", "e1", "e2", "e0", "e1", "process_name"]
    assert doc["otherData"] == {"max_events": 5, "timed_events": 5, "dropped_events": 2}
    again = TraceFile(path, max_events=6, resume=True)  # --resume keeps them, counting toward the cap
    again.close(_events(3))
    doc = read_trace(path)
    assert [e["name"] for e in doc["traceEvents"]][-3:] == ["e1", "process_name", "e0"]
    assert doc["otherData"] == {"max_events": 6, "timed_events": 6, "dropped_events": 2}


def test_a_file_cut_anywhere_reads_up_to_its_last_whole_event(tmp_path):
    path = tmp_path / "trace.json"
    f = TraceFile(path, max_events=100)
    f.write(_events(4))
    f.close()
    whole = path.read_bytes()
    cut = tmp_path / "cut.json"
    seen = set()
    for n in range(len(whole) + 1):
        cut.write_bytes(whole[:n])
        got = [e["name"] for e in read_trace(cut)["traceEvents"]]
        assert got == [f"e{i}" for i in range(len(got))], n  # a prefix, never a broken event
        seen.add(len(got))
    assert seen == {0, 1, 2, 3, 4}


WRITER = """
import sys
from dataplane_rl.trace import TraceFile
f = TraceFile(sys.argv[1], max_events=10**9)
i = 0
while True:
    f.write([{"name": "e", "ph": "X", "ts": i, "dur": 1, "pid": 1, "tid": 1, "args": {"pad": "x" * 500}}] * 50)
    i += 1
"""


def test_a_writer_killed_mid_run_leaves_a_file_the_reader_takes(tmp_path):
    path = tmp_path / "trace.json"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env)
    try:
        deadline = time.monotonic() + 60
        while (not path.exists() or path.stat().st_size < 2_000_000) and time.monotonic() < deadline:
            assert p.poll() is None, "the writer died"
            time.sleep(0.02)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    events = read_trace(path)["traceEvents"]
    assert len(events) >= 1000 and all(e["name"] == "e" for e in events)


@pytest.mark.parametrize("on", [True, False])
def test_traced_functions_record_only_when_on(on):
    from dataplane_rl import trace

    @trace.traced("work")
    def work(x):
        return x + 1

    trace.configure(on)
    try:
        assert work(1) == 2
        got = [e["name"] for e in trace.take() if e["ph"] == "X"]
    finally:
        trace.configure(False)
    assert got == (["work"] if on else [])


def test_the_trace_command_sums_phases_and_draws_the_timeline(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "trace", *args], capture_output=True,
                              text=True, timeout=120)

    t = Tracer()
    t.configure(True, "driver", ["driver", "rollout-0"])
    for step in (1, 2):
        with t.span("step", step=step):
            with t.span("train"):
                time.sleep(0.002)
    f = TraceFile(tmp_path / "trace.json", max_events=100)
    f.write(t.take())
    f.write([{"name": "generate", "ph": "X", "ts": 0, "dur": 5_000_000, "pid": 10_001, "tid": 1, "args": {}}])
    f.close()
    p = cli(str(tmp_path), "--json", "--png", str(tmp_path / "t.png"), "--steps", "2-2")
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in p.stdout.splitlines()]
    assert [(r["process"], r["phase"], r["count"]) for r in rows] == \
        [("driver", "step", 2), ("driver", "train", 2), ("rollout-0", "generate", 1)]  # driver first, longest first
    assert rows[0]["seconds"] >= rows[1]["seconds"] >= 0.004 and rows[2]["seconds"] == 5.0
    assert (tmp_path / "t.png").stat().st_size > 10_000
    p = cli(str(tmp_path / "none"))
    assert p.returncode == 2 and "no trace.json" in p.stderr, p.stderr


def test_the_clock_offset_skips_a_preempted_read(monkeypatch):
    """Each process maps perf_counter to the wall clock once: a try whose two perf_counter reads a preemption split
    (4.3 ms once, on a busy machine) is not the one kept."""
    from dataplane_rl import trace

    perf = iter([0, 4_300_000, 10_000_000, 10_000_400, 20_000_000, 20_000_900])  # try 1 preempted 4.3 ms
    wall = iter([1_000_000_000 + 4_300_000, 1_000_000_000 + 10_000_200, 1_000_000_000 + 20_000_450])
    monkeypatch.setattr(trace.time, "perf_counter_ns", lambda: next(perf))
    monkeypatch.setattr(trace.time, "time_ns", lambda: next(wall))
    assert trace._wall_offset_ns(tries=3) == 1_000_000_000  # try 2's midpoint: the wall clock is perf + 1 s
