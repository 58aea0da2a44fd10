"""Smoke tests of the benchmarks through the CLI, with tiny budgets. They check the output's shape and
that every reported number is a positive measurement; they never assert a speed."""

import json
import re
import subprocess
import sys

import pytest


def bench(*args):
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "bench", *args], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_bench_store_json_and_plot(tmp_path):
    """Two writers putting groups of 4 rows, two readers, a teacher's top-8 in the workload: the store and
    every reference ran with them, and every process of it exited 0 (a reference's crash at exit used to go
    unseen)."""
    out = tmp_path / "store.json"
    png = tmp_path / "store.png"
    p = bench("store", "--backends", "shm,mooncake", "--samples", "32", "--min-len", "8", "--max-len", "64",
              "--writers", "2", "--group-size", "4", "--readers", "2", "--repeats", "2", "--small-repeats", "2",
              "--fit-sizes", "none", "--topk", "8", "--json", str(out), "--plot", str(png))
    res = json.loads(out.read_text())
    assert res["workload"]["writers"] == 2 and res["workload"]["group_size"] == 4
    # --topk 8: the teacher's [L, 8] log-probs and ids ride along, 64 bytes a token on top of the GRPO columns
    assert res["workload"]["topk"] == 8 and res["workload"]["bytes_per_token"] > 64
    for name in ("memcpy", "shm_floor", "raw_mooncake", "mooncake_floor", "shm", "mooncake"):
        procs = res[name]["processes"]
        assert [q["role"] for q in procs] == ["writer 0", "writer 1", "reader 0", "reader 1"], name
        assert all(q["exitcode"] == 0 and q["peak_rss_mb"] > 0 for q in procs), (name, procs)
        assert all(q["held_mb"] > 0 for q in procs), (name, procs)  # every one of them moved bytes
        assert not any(q["copies_shard"] for q in procs), (name, procs)
    assert "fit" not in res["shm"]
    assert "| shm | reader 1 | 0 |" in p.stdout and "| raw_mooncake | writer 1 | 0 |" in p.stdout
    assert "| mooncake_floor | reader 1 | 0 |" in p.stdout
    assert res["fresh_pages"]["e2e_gbps"]["median"] > 0
    for name in ("shm", "mooncake"):
        for key in ("write_gbps", "read_gbps", "e2e_gbps"):
            assert res[name][key]["median"] > 0
        assert res[name]["ratio_to_memcpy"] > 0
        assert res[name]["cold"]["e2e_gbps"] > 0 and res[name]["cold"]["ratio_to_fresh_pages"] > 0
        assert len(res[name]["rounds_e2e_gbps"]) == 2 + 2  # cold, warm-up, the 2 steady rounds
        # what the workers retried is reported (an idle machine may need none), in the JSON and the log line
        assert isinstance(res[name]["retries"], int) and res[name]["retries"] >= 0
        assert f"the workers retried {res[name]['retries']} transient answers" in p.stderr + p.stdout
        small = res[name]["small"]
        for key in ("put_us", "get_us", "remote_get_us", "put_full_us", "remote_get_full_us",
                    "put_full_first_step_us", "remote_get_full_first_step_us"):
            assert small[key]["median"] > 0, key
    for name in ("shm", "mooncake", "shm_floor"):  # each process's CPU a steady round, the store's and the floor's
        cpu = res[name]["round_cpu_ms"]
        assert cpu["writers"]["median"] > 0 and cpu["readers"]["median"] > 0, (name, cpu)
        writer = f"a writer {cpu['writers']['median']:.1f} ms, a reader {cpu['readers']['median']:.1f} ms"
        assert writer in p.stderr + p.stdout, (name, writer)
    assert res["mooncake"]["ratio_to_raw_mooncake"] > 0 and res["raw_mooncake"]["e2e_gbps"]["median"] > 0
    # the Mooncake floor: raw with the copies and checksums, its own column in the table
    assert res["mooncake"]["ratio_to_mooncake_floor"] > 0 and res["mooncake_floor"]["e2e_gbps"]["median"] > 0
    assert "x Mooncake floor" in p.stdout
    assert png.stat().st_size > 1000
    assert "| shm |" in p.stdout and "| memcpy |" in p.stdout and "| fresh_pages |" in p.stdout
    assert "get, other process" in p.stdout


def test_bench_store_fit_separates_per_call_and_per_byte(tmp_path):
    """The fit runs the rounds at 1 and 16 rows per call; rows of ~12k tokens make the bytes of a 16-row call
    (~3.4 MB) cost well over its fixed part, so the fit of the CPU time the calls took finds a positive
    bandwidth for put and get (the wall-clock fit too on a quiet machine; on a loaded one its points can
    swap, which the fit reports as no bandwidth resolved); the 16-row put target is judged."""
    out = tmp_path / "fit.json"
    p = bench("store", "--backends", "shm", "--samples", "32", "--min-len", "8192", "--max-len", "16384",
              "--writers", "2", "--readers", "1", "--repeats", "1", "--small-repeats", "0", "--fit-sizes", "1,16",
              "--fit-repeats", "2", "--json", str(out))
    res = json.loads(out.read_text())
    fit = res["shm"]["fit"]
    assert set(fit) == {"put", "get"}
    for op in ("put", "get"):
        for f in (fit[op], fit[op]["cpu"]):
            points = f["points"]
            assert [q["rows"] for q in points] == [1, 16]
            assert all(q["us_per_call"] > 0 and q["observations"] >= 2 for q in points)
            assert points[1]["bytes_per_call"] > 10 * points[0]["bytes_per_call"]
        assert fit[op]["cpu"]["bandwidth_gbps"] > 0 and fit[op]["cpu"]["per_call_us"] > 0
        assert fit[op]["bandwidth_gbps"] is None or fit[op]["bandwidth_gbps"] > 0
    (put16,) = [t for t in res["targets"] if "16 rows" in t["target"]]
    assert put16["measured"] == round(fit["put"]["points"][1]["us_per_call"], 1) and put16["pass"] in (True, False)
    assert [t["target_workload"] for t in res["targets"] if "floor" in t["target"]] == [False]
    assert all(q["exitcode"] == 0 for q in res["shm"]["processes"] + res["shm_floor"]["processes"])
    assert "Fit of time = calls x per_call + bytes / bandwidth" in p.stdout and "| shm | put, CPU |" in p.stdout
    assert "Targets (the ratios' target workload" in p.stdout


def test_bench_store_options_have_help_with_their_defaults():
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "bench", "store", "--help"],
                       capture_output=True, text=True, timeout=120)
    text = " ".join(p.stdout.split())  # argparse wraps lines
    for option, default in (("--samples", 512), ("--min-len", 256), ("--max-len", 1024), ("--writers", 1),
                            ("--readers", 2), ("--group-size", 8), ("--repeats", 10), ("--fit-sizes", "4,16,64"),
                            ("--fit-repeats", 3), ("--small-repeats", 20), ("--topk", 0)):
        meta = option.lstrip("-").upper().replace("-", "_")
        help_ = re.search(rf"  ?{option} {meta} (.*?)(?= --[a-z]|$)", text.split("options:")[1])
        assert help_ and help_.group(1).endswith(f"(default {default})"), (option, help_ and help_.group(1))


def test_bench_store_rejects_unknown_backend():
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "bench", "store", "--backends", "redis"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "unknown backend 'redis'" in p.stderr


def test_bench_store_refuses_out_of_range_values_up_front(capsys):
    """`--samples 1000000000000` (numpy's MemoryError) and `--group-size 0` (the raw Mooncake reference's ValueError,
    after the shm rounds had run) ended in tracebacks. Each value is refused before anything runs, in one line
    naming the flag, the value and the range it may take."""
    import argparse

    from dataplane_rl.bench.store import run_args
    from dataplane_rl.bench.store_args import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for argv, says in (
            (["--samples", "1000000000000"], r"error: --samples 1000000000000: rows of 256-1024 tokens make a batch of "
                                             r"about \d+ MiB, .* use 1-\d+ samples at these lengths"),
            (["--max-len", "100000000000"], r"error: --max-len 100000000000: one row of up to 100000000000 tokens"),
            (["--group-size", "0"], r"error: --group-size 0: 512 samples make 1 group\(s\) for 2 readers, .* use a "
                                    r"--group-size of 1-511 \(0: one group per writer, so --writers at least --readers\)"
                                    r", or leave mooncake out of --backends"),
            (["--group-size", "600"], r"error: --group-size 600: .* use a --group-size of 1-511, or leave mooncake"),
            (["--topk", "2000000"], r"error: --topk 2000000: a token of a shaped column holds at most 1048576 values; "
                                    r"use 0-1048576"),
            (["--writers", "100000", "--samples", "100000"], r"error: --writers 100000 and --readers 2: 100002 "
                                                             r"processes of about 128 MiB each")):
        assert run_args(parser.parse_args(argv)) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.match(says, err[0]), (argv, err)


def test_bench_generate_without_vllm_benches_hf_alone_or_refuses_in_one_line(monkeypatch, capsys):
    """vllm made unimportable: the default backends are hf alone, said in one line; naming vllm is one
    `error:` line (as `train` gives), not a worker's nested traceback."""
    no_vllm = "import sys; sys.modules['vllm'] = None; from dataplane_rl.cli.main import main; sys.exit(main())"
    p = subprocess.run([sys.executable, "-c", no_vllm, "bench", "generate", "--backends", "hf,vllm"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: --backends hf,vllm: vllm is not installed; install the")
    assert len(p.stderr.splitlines()) == 1, p.stderr
    from dataplane_rl.bench.generate import pick_backends

    monkeypatch.setitem(sys.modules, "vllm", None)
    assert pick_backends(None) == ["hf"]
    assert capsys.readouterr().err.startswith("bench generate: vllm is not installed, so only hf runs")
    assert pick_backends("hf,vllm") == ["hf", "vllm"]  # as asked: run_args refuses it, above


def test_bench_e2e_reports_data_plane_share(tmp_path):
    out = tmp_path / "e2e.json"
    # one transport: each starts its own Ray, which costs more than the steps
    p = bench("e2e", "--transports", "shm", "--steps", "2", "--json", str(out), "grpo.num_prompts_per_step=4",
              "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16", "generation.max_new_tokens=4")
    (res,) = json.loads(out.read_text())["results"]
    assert res["transport"] == "shm" and res["step_s"] > 0
    assert res["bytes_per_step"] > 0 and res["data_plane_s"] > 0
    assert 0 < res["driver_bytes_read"] < res["bytes_per_step"]
    # the printed table is in the units docs/benchmarks.md uses (kB), so a reader can compare the two
    header, row = p.stdout.splitlines()[-2:]
    assert header.split()[-3:] == ["kB/step", "driver", "kB"]
    assert row.split()[-2:] == [f"{res['bytes_per_step'] / 1e3:.1f}", f"{res['driver_bytes_read'] / 1e3:.1f}"]


def test_bench_e2e_async_reports_ratios_to_sync_and_ideal(tmp_path):
    out = tmp_path / "async.json"
    p = bench("e2e", "--async", "--configs", "default", "--steps", "2", "--json", str(out),
              "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
              "generation.max_new_tokens=4")
    (res,) = json.loads(out.read_text())["results"]
    assert res["config"] == "default" and res["sync"]["mode"] == "sync" and res["async"]["mode"] == "async"
    assert res["sync"]["samples_per_s"] > 0 and res["async"]["samples_per_s"] > 0 and res["gen_s"] > 0
    assert res["ideal_samples_per_s"] >= res["sync"]["samples_per_s"] * 0.999  # max(gen, train) <= gen + train
    assert res["async"]["staleness_mean"] == 1.0 and res["sync"]["staleness_mean"] == 0.0
    assert "| default |" in p.stdout


def test_bench_train_compares_padded_dynamic_packed(tmp_path):
    out = tmp_path / "train.json"
    p = bench("train", "--model", "tiny", "--rows", "6", "--repeats", "1", "--budget", "2048", "--json", str(out))
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"padded", "dynamic", "packed", "packed_sdpa"}
    assert res["modes"]["packed"]["padding_fraction"] == 0 < res["modes"]["padded"]["padding_fraction"]
    assert all(r["tokens_per_s"] > 0 for r in res["modes"].values()) and res["ideal_ratio"] > 1
    assert "packed" in p.stdout and "ideal" in p.stdout


def test_a_bad_json_or_plot_target_is_refused_before_the_benchmark_runs(tmp_path):
    """Every command that writes a file checks it first (store/targets.py): a --json inside a store folder or in
    a missing folder is one line, and the benchmark never starts."""
    from dataplane_rl.store import open_store

    store = open_store(f"shm://{tmp_path}/s")
    store.close()
    for opt, target, says in (("--json", tmp_path / "s" / "x.json", "inside the column store folder"),
                              ("--plot", tmp_path / "nope" / "x.png", "does not exist; create it first")):
        p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "bench", "store", "--backends", "shm",
                            "--samples", "8", opt, str(target)], capture_output=True, text=True, timeout=600)
        assert p.returncode == 2 and p.stderr.strip().splitlines() == [p.stderr.strip()], p.stderr[-3000:]
        assert p.stderr.startswith(f"error: ConfigError: bench store {opt} {target}") and says in p.stderr, p.stderr
    assert sorted(x.name for x in (tmp_path / "s").iterdir() if not x.name.startswith(".")) == []



def test_a_failed_bench_worker_is_one_line_naming_worker_backend_and_error(tmp_path, capfd):
    """Real `bench store` writers on a real shm store: the partition holds only writer 0's rows, so the store
    refuses writer 1's put. That error reaches the bench as one line naming the backend, the worker and the
    store's own error (no traceback, no EOFError from its pipe), not the broken barrier writer 0 stops on."""
    from dataplane_rl.bench.store import store_pool
    from dataplane_rl.bench.store_procs import WorkerFailed
    from dataplane_rl.bench.store_work import Workload, bench_schema
    from dataplane_rl.store import open_store

    work = Workload(samples=8, min_len=4, max_len=8, writers=2, readers=1, group_size=4)  # rows 0-3 and 4-7
    store = open_store(f"shm://{tmp_path / 'store'}")
    pool = store_pool("shm", store.url, work)
    try:
        pool.ready()
        store.create_partition("short", bench_schema(), 4)
        with pytest.raises(WorkerFailed) as failed:
            pool.ask_all(pool.writers, ("put", "short", work.group_size))
    finally:
        pool.abort()
        store.close()
    line = str(failed.value)
    assert line.startswith("shm writer 1: ") and "partition short" in line and "\n" not in line, line
    assert "BrokenBarrierError" not in line and "Traceback" not in capfd.readouterr().err


def peers_args(*argv):
    import argparse

    from dataplane_rl.bench.peers import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_bench_peers_refuses_bad_options_before_anything_runs():
    """Each bad option is one ConfigError naming the option, its value and the fix; an override of a setting both
    sides mirror is refused (it would make the dataplane-rl run differ from TRL's), naming the option that sets it."""
    from dataplane_rl.bench.peers import check_args
    from dataplane_rl.errors import ConfigError

    assert check_args(peers_args()) == ["sync"]
    assert check_args(peers_args("--variants", "sync,async,packing", "policy.sequence_packing.algorithm=concatenative",
                                 "policy.model=tiny")) == ["sync", "async", "packing"]
    for argv, says in ((["--steps", "1"], "--steps 1: the first step is not timed, so at least 2 are needed"),
                       (["--generations", "1"], "--generations 1: must be at least 2"),
                       (["--micro-batches", "3"], "--micro-batches 3: a step's 16 samples"),
                       (["--variants", "sync,fast"], "unknown variant 'fast'; use a comma list of sync, async, "
                                                     "packing"),
                       (["--trl-only", "--variants", "async"], "the variants are dataplane-rl runs"),
                       (["data_plane.enabled"], "override 'data_plane.enabled' is not key=value"),
                       (["grpo.num_prompts_per_step=8"], "a setting both mirror; use --prompts"),
                       (["policy.scheduler.name=cosine"], "a setting both mirror; the bench fixes it for both sides"),
                       (["task.path=x.parquet"], "a setting both mirror; use --data"),
                       (["--data", "nope.parquet"], "--data nope.parquet: no such file")):
        with pytest.raises(ConfigError) as e:
            check_args(peers_args(*argv))
        assert says in str(e.value) and str(e.value).startswith("bench peers") and "\n" not in str(e.value), argv
    with pytest.raises(SystemExit):  # argparse: not allowed together
        peers_args("--dataplane-only", "--trl-only")


def test_bench_peers_without_trl_is_one_line_naming_the_extra():
    """TRL made unimportable: one `error:` line naming the `peers` extra, before any run starts."""
    no_trl = "import sys; sys.modules['trl'] = None; from dataplane_rl.cli.main import main; sys.exit(main())"
    p = subprocess.run([sys.executable, "-c", no_trl, "bench", "peers", "--steps", "2"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: ConfigError: bench peers: TRL is not installed; install "
                                                     "the `peers` extra (pip install -e '.[peers]')"), p.stderr
    assert len(p.stderr.splitlines()) == 1 and p.stdout == "", p.stderr


# a process that fills 64 MiB, forks a child that shares those pages (copy-on-write, never written) and starts a
# grandchild filling 32 MiB of its own; each waits for stdin to close
TREE = r"""
import os, subprocess, sys
MiB = 2**20
def fill(n):
    b = bytearray(n)
    for i in range(0, n, 4096):
        b[i] = 1
    return b
shared = fill(64 * MiB)
pid = os.fork()
if pid == 0:
    grand = subprocess.Popen([sys.executable, "-c", "import sys\nb = bytearray(32 * 2**20)\nfor i in range(0, len(b), "
                              "4096): b[i] = 1\nprint('filled', flush=True)\nsys.stdin.read()"], stdout=subprocess.PIPE)
    grand.stdout.readline()
    print("ready", flush=True)
    sys.stdin.read()
    grand.wait()
    os._exit(0)
sys.stdin.read()
os.waitpid(pid, 0)
"""


def test_tree_memory_sums_pss_over_a_real_process_tree_counting_shared_pages_once():
    """The sampler walks the tree (root, forked child, grandchild) and sums PSS: the 64 MiB the root and its forked
    child share count once, so the sum is 64 + 32 MiB plus three interpreters (~10 MiB each here), where RSS would
    count the shared 64 MiB twice (160 MiB and up)."""
    import select

    import psutil

    from dataplane_rl.bench.tree_memory import TreeMemory

    p = subprocess.Popen([sys.executable, "-c", TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([p.stdout], [], [], 120)[0], "the process tree did not start"
        assert p.stdout.readline().strip() == "ready"
        tree = [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]
        rss = sum(q.memory_info().rss for q in tree) / 2**20
        with TreeMemory(p.pid, interval=0.05) as mem:
            pass  # one sample when it starts, one when it stops: the tree is complete for both
        got = mem.result()
    finally:
        p.stdin.close()
        p.wait(timeout=60)
    assert len(tree) == 3 and got["kind"] == "pss" and got["processes_at_peak"] == 3 and got["samples"] >= 2, got
    assert 96 <= got["peak_mb"] < 96 + 50, got
    # each process's share of the peak, largest first, named by its program
    shares = got["at_peak"]
    assert sorted(x["pid"] for x in shares) == sorted(q.pid for q in tree) and all(x["process"].startswith("python")
                                                                                   for x in shares), shares
    assert [x["mb"] for x in shares] == sorted((x["mb"] for x in shares), reverse=True)
    assert abs(sum(x["mb"] for x in shares) - got["peak_mb"]) < 1e-6
    assert rss - got["peak_mb"] > 50, (rss, got)  # RSS counts the shared 64 MiB in both processes
    assert mem.sample() == 0 and mem.result() == got  # the tree has exited: nothing to count, the peak kept
