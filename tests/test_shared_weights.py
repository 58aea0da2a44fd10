"""Refit through shared memory (model/shared_weights.py): rank 0 writes a version once, the actors of its node map it.

Real files in a real tmpfs-like folder (DATAPLANE_RL_SHM_ROOT points the auto-made folders at the test's own), a
real tiny model in the Hugging Face engine, and a real killed publisher for the collection of a dead run's folder.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch

from dataplane_rl.model.load import load_model, load_tokenizer, resolve_model
from dataplane_rl.model.shared_weights import ALIGN, SharedWeights, WeightsFolder, attach
from dataplane_rl.rollout.engine import HFEngine
from dataplane_rl.store.shm import owners


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv(owners.ROOT_ENV, str(tmp_path))
    return tmp_path


def test_a_version_is_written_once_and_read_in_place(root):
    tied = torch.randn(7, 3)
    state = {"emb": tied, "head": tied, "half": torch.randn(5).to(torch.bfloat16), "steps": torch.arange(4),
             "cols": torch.randn(3, 4).t()}  # a non-contiguous tensor is written in its logical order
    folder = WeightsFolder()
    shared = folder.publish(state, 1)
    assert shared.version == 1 and shared.here() and shared.nbytes % ALIGN == 0
    offsets = {k: off for k, _, _, off in shared.entries}
    assert offsets["emb"] == offsets["head"] and len(set(offsets.values())) == 4  # tied weights stored once
    assert all(off % ALIGN == 0 for off in offsets.values())
    assert os.stat(shared.path).st_mode & 0o777 == 0o600  # the run's own
    assert owners.read_owner(folder.folder)["pid"] == os.getpid()  # collectable when this process dies
    views = attach(shared)
    for k, t in state.items():
        assert views[k].dtype == t.dtype and torch.equal(views[k], t), k
    assert views["emb"].data_ptr() == views["head"].data_ptr()
    again = attach(shared)  # a second mapper reads the same pages
    assert torch.equal(again["half"], state["half"])
    folder.close()
    assert not os.path.exists(folder.folder or shared.path) and not list(root.iterdir())


def test_old_versions_go_but_a_mapped_one_reads_on(root):
    folder = WeightsFolder()
    one = folder.publish({"w": torch.ones(1000)}, 1)
    mapped = attach(one)["w"]
    two = folder.publish({"w": torch.full((1000,), 2.0)}, 2)  # nothing open needs version 1: unlinked
    assert not os.path.exists(one.path) and not one.here() and two.here()
    assert float(mapped.sum()) == 1000.0  # the actor that maps version 1 generates on with it
    with pytest.raises(RuntimeError, match="version 1 .* were removed; a rollout actor on another node"):
        attach(one)
    three = folder.publish({"w": torch.full((1000,), 3.0)}, 3, keep={2})  # an open job was sent with version 2
    assert two.here() and three.here()
    assert float(attach(two)["w"].sum()) == 2000.0 and float(attach(three)["w"].sum()) == 3000.0
    assert sorted(os.listdir(folder.folder)) == sorted([owners.MARKER, owners.OWNER_FILE, "v000002", "v000003"])
    elsewhere = SharedWeights(3, three.path, "another-host", three.boot, three.nbytes, three.entries)
    with pytest.raises(RuntimeError, match="not on this machine"):
        attach(elsewhere)
    folder.close()


def test_the_engine_generates_from_views_of_the_file_as_from_a_copy(root, tmp_path):
    folder_path = resolve_model("tiny", 0, str(tmp_path / "cache"))
    tok = load_tokenizer(folder_path)
    trained = load_model(folder_path, torch.device("cpu"))
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))  # weights no engine started with
    copied, shared = (HFEngine(load_model(folder_path, torch.device("cpu")), [tok.eos_token_id], tok.pad_token_id)
                      for _ in range(2))
    copied.load_weights(trained.state_dict())
    weights = WeightsFolder()
    version = weights.publish(trained.state_dict(), 1)
    shared.load_weights(version)
    # every parameter a view of one mapping of the file: no private copy in the actor
    storages = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in shared.model.parameters()}
    assert len(storages) == 1 and storages.pop()[1] == version.nbytes
    prompts = [tok("407", add_special_tokens=False).input_ids, tok("12", add_special_tokens=False).input_ids]
    for temperature in (0.0, 1.0):
        a, b = (e.generate(prompts, [1, 2], 8, temperature=temperature) for e in (copied, shared))
        assert [(g.tokens, g.logprobs) for g in a] == [(g.tokens, g.logprobs) for g in b]
    weights.close()


def test_a_live_version_is_the_trainers_own_parameters(root, tmp_path):
    """publish_live moves the trainer's parameters into the file once: an optimizer step then changes what an actor
    generates with, a refit copies nothing and the engine's load is a no-op; a parameter replaced since (a checkpoint
    load) is moved back in; the actors' numbers are those of a copy of the same weights."""
    folder_path = resolve_model("tiny", 0, str(tmp_path / "cache"))
    tok = load_tokenizer(folder_path)
    trainer = load_model(folder_path, torch.device("cpu"))
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    weights = WeightsFolder()
    one = weights.publish_live(trainer, 1)
    assert one.live and one.here()
    ptrs = [p.data_ptr() for p in trainer.parameters()]
    storages = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in trainer.parameters()}
    assert len(storages) == 1 and storages.pop()[1] == one.nbytes  # every parameter a view of one mapping
    actor, copied = (HFEngine(load_model(folder_path, torch.device("cpu")), [tok.eos_token_id], tok.pad_token_id)
                     for _ in range(2))
    actor.load_weights(one)
    assert actor.live == one.path
    prompts = [tok("407", add_special_tokens=False).input_ids, tok("12", add_special_tokens=False).input_ids]
    before = [g.logprobs for g in actor.generate(prompts, [1, 2], 8, temperature=1.0)]
    trainer(input_ids=torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss.backward()
    opt.step()  # in place, in the shared file
    two = weights.publish_live(trainer, 2)
    assert (two.path, [p.data_ptr() for p in trainer.parameters()]) == (one.path, ptrs)  # nothing moved or copied
    actor.load_weights(two)  # a no-op: the views already hold version 2
    copied.load_weights(trainer.state_dict())
    after, expected = ([(g.tokens, g.logprobs) for g in e.generate(prompts, [1, 2], 8, temperature=1.0)]
                       for e in (actor, copied))
    assert after == expected and [lp for _, lp in after] != before
    name, param = next(trainer.named_parameters())
    param.data = param.data.clone() + 1.0  # replaced, as set_state_dict may do
    three = weights.publish_live(trainer, 3)
    assert param.data_ptr() == ptrs[0] and torch.equal(attach(three)[name], param.data)  # moved back in
    assert sorted(os.listdir(weights.folder)) == sorted([owners.MARKER, owners.OWNER_FILE, os.path.basename(one.path)])
    # the export's and the object store's state dict: each tensor its own bytes, not a view of the whole mapping,
    # which a pickle would carry once per tensor (a 135M model's export once took 20 GB that way)
    from dataplane_rl.train.fsdp import full_state_dict

    exported = full_state_dict(trainer)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in exported.values())
    assert len(pickle.dumps(exported)) < 2 * one.nbytes
    copy = weights.publish(trainer.state_dict(), 4)  # a copy from here on (e.g. an async step)
    assert not copy.live and copy.path != one.path and weights.live is None
    weights.close()


PUBLISH_AND_HANG = """
import sys, time, torch
from dataplane_rl.model.shared_weights import WeightsFolder
f = WeightsFolder()
print(f.publish({"w": torch.ones(10)}, 1).path, flush=True)
time.sleep(120)
"""


def test_a_killed_trainers_folder_is_collected(root):
    child = subprocess.Popen([sys.executable, "-c", PUBLISH_AND_HANG], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ))
    try:
        path = child.stdout.readline().strip()
        assert path and os.path.exists(path), child.poll()
        folder = os.path.dirname(path)
        assert owners.collect(str(root)) == [] and os.path.exists(path)  # its owner lives: kept
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        deadline = time.monotonic() + 30
        while owners.owner_alive(owners.read_owner(folder)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [f.path for f in owners.collect(str(root))] == [folder] and not os.path.exists(folder)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
