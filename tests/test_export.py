"""`rtrain export`: a checkpoint's weights (and optimizer state) as safetensors or a torch.save
state dict, compared bitwise with the model and optimizer that were saved; damaged checkpoints
refused with the verifier's reason; a malicious pickle refused and never run; OUT never overwritten
without --force. The safetensors export of rtrain's format runs in this process (torch-free); the
torch side (`rtrain.worker.export.convert`) is called in-process here and through the real command
in the tests marked slow."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run_rtrain
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_foreign_verify import flip
from torch import nn

import rtrain
from rtrain.supervisor.core.errors import CheckpointError
from rtrain.worker.export import convert as wexport

pytestmark = pytest.mark.usefixtures("unsupervised")


def trained(tmp_path: Path, steps: int = 3, **ck) -> tuple[nn.Module, torch.optim.Optimizer, Path]:
    """A tiny model and Adam after `steps` steps, saved by the Checkpointer in tmp_path/ckpt."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.95))
    for _ in range(steps):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    path = rtrain.Checkpointer(model=model, optimizer=opt, ckpt_dir=tmp_path / "ckpt",
                               **ck).save(steps)
    return model, opt, path


def bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)))


def same_state_dict(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert bitwise(got[k], want[k]), k


def leftovers(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if ".rtrain-export-" in p.name]


# ----------------------------------------------------------------- rtrain's format, torch-free

def test_rtrain_checkpoint_to_safetensors_is_bitwise_the_model_and_optimizer(rtrain, tmp_path):
    model, opt, path = trained(tmp_path)
    out = tmp_path / "model.safetensors"
    r = rtrain("export", str(path), str(out))
    assert r.returncode == 0, r.stderr
    assert "exported the model weights of checkpoint-3 (rtrain, step 3, verified full)" in r.stdout
    assert f"wrote {out} (safetensors, 4 tensors" in r.stdout
    same_state_dict(load_file(str(out)), model.state_dict())

    both = tmp_path / "both.safetensors"
    r = rtrain("export", str(path), str(both), "--optimizer")
    assert r.returncode == 0, r.stderr
    got = load_file(str(both))
    same_state_dict({k: v for k, v in got.items() if not k.startswith("optimizer/")},
                    model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    for i, st in opt.state_dict()["state"].items():
        for key, t in st.items():
            assert bitwise(got[f"optimizer/{names[i]}/{key}"], t)
    with safe_open(str(both), "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    groups = json.loads(meta["optimizer"])["param_groups"]
    assert groups[0]["params"] == names and groups[0]["lr"] == 1e-3
    assert leftovers(tmp_path) == []


def test_an_encrypted_checkpoint_exports_with_its_key_only(rtrain, tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    key = "ab" * 32
    monkeypatch.setenv("RTRAIN_ENCRYPTION_KEY", key)
    model, _, path = trained(tmp_path)
    monkeypatch.delenv("RTRAIN_ENCRYPTION_KEY")
    out = tmp_path / "w.safetensors"
    r = rtrain("export", str(path), str(out))
    assert r.returncode == 1 and "encrypted with the key of fingerprint" in r.stderr
    assert not out.exists() and leftovers(tmp_path) == []
    r = rtrain("export", str(path), str(out), env={"RTRAIN_ENCRYPTION_KEY": key})
    assert r.returncode == 0, r.stderr
    same_state_dict(load_file(str(out)), model.state_dict())


def test_bytes_changed_after_verification_are_caught_while_copied(tmp_path, make_ckpt):
    """The copy hashes what it copies: a file changed between the verification and the copy
    (here: before the copy, the manifest already read) fails, and nothing is published."""
    from rtrain.checkpoint import manifest, st_concat
    from rtrain.checkpoint.verified_read import open_listed

    path = make_ckpt(tmp_path / "ckpt", 100)
    m = manifest.load(path)
    flip(path / "model.safetensors", -3)
    part = st_concat.Part("model", lambda: open_listed(path, "model.safetensors", m,
                                                       "xxh3-128"))
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(ValueError, match=r"model: model\.safetensors: content hash does "
                                             r"not match the manifest"):
            st_concat.concat([part], fd)
    finally:
        os.close(fd)


def test_a_directory_exports_the_newest_checkpoint_that_verifies(rtrain, tmp_path, make_ckpt):
    ckpt = tmp_path / "ckpt"
    make_ckpt(ckpt, 100)
    flip(make_ckpt(ckpt, 200) / "model.safetensors", -3)
    r = rtrain("export", str(ckpt), str(tmp_path / "w.safetensors"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == ("skipped checkpoint-200: corrupt: file 'model.safetensors' content hash "
                        "does not match the manifest (bytes changed on disk)")
    assert lines[1] == "picked checkpoint-100: the newest checkpoint that verifies"
    got = load_file(str(tmp_path / "w.safetensors"))
    assert int(got["step"]) == 100 and got["fc.weight"].shape == (4, 3)


def test_a_damaged_checkpoint_is_refused_with_the_verifiers_reason(rtrain, tmp_path, make_ckpt):
    bad = make_ckpt(tmp_path / "ckpt", 200)
    flip(bad / "model.safetensors", -3)
    out = tmp_path / "w.safetensors"
    r = rtrain("export", str(bad), str(out))
    assert r.returncode == 1
    assert r.stderr == ("rtrain: error: checkpoint-200 failed full verification: corrupt: file "
                        "'model.safetensors' content hash does not match the manifest (bytes "
                        "changed on disk); not exported\n")
    assert not out.exists() and leftovers(tmp_path) == []
    (bad / "manifest.json").unlink()
    r = rtrain("export", str(bad), str(out))
    # Without its manifest the dir looks like an unfinished Trainer save (model.safetensors).
    assert r.returncode == 1 and "failed full verification: incomplete: " in r.stderr


def test_out_is_never_overwritten_without_force(rtrain, tmp_path, make_ckpt):
    path = make_ckpt(tmp_path / "ckpt", 100)
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"precious")
    r = rtrain("export", str(path), str(out))
    assert r.returncode == 2
    assert r.stderr == f"rtrain: error: {out} exists: pass --force to replace it\n"
    assert out.read_bytes() == b"precious"
    r = rtrain("export", str(path), str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert int(load_file(str(out))["step"]) == 100 and leftovers(tmp_path) == []


@pytest.mark.parametrize(("args", "why"), [
    (("missing", "w.safetensors"), "no checkpoint at missing"),
    (("ckpt/checkpoint-100", "w.onnx"), "cannot tell the format from w.onnx: name it "
                                        ".safetensors or .pt, or pass --format"),
    (("ckpt/checkpoint-100", "nodir/w.pt"), "no directory nodir to write w.pt in"),
    (("ckpt/checkpoint-100", "ckpt"),
     "ckpt is a directory: name the file to write, e.g. ckpt/model.safetensors"),
    (("ckpt/checkpoint-100", "ckpt/checkpoint-100/w.safetensors"),
     "is inside the checkpoint checkpoint-100: write the export elsewhere"),
    (("ckpt/checkpoint-100", "ckpt/export.pt"),
     "would sit beside checkpoint-100 in its checkpoint directory, where a launch would take "
     "it for a checkpoint"),
    (("empty", "w.safetensors"), "no checkpoint in empty"),
])
def test_bad_input_is_one_line_and_exit_2(rtrain, tmp_path, make_ckpt, args, why):
    make_ckpt(tmp_path / "ckpt", 100)
    (tmp_path / "empty").mkdir()
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    r = rtrain("export", *args, cwd=tmp_path)
    assert r.returncode == 2, r.stdout
    assert r.stderr.startswith("rtrain: error: ") and r.stderr.count("\n") == 1
    assert why in r.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before


def test_no_model_weights_and_no_optimizer_are_refused(rtrain, tmp_path, make_ckpt):
    opt_only = make_ckpt(tmp_path / "a", 5, tensors={"optimizer.safetensors": []})
    r = rtrain("export", str(opt_only), str(tmp_path / "w.safetensors"))
    assert r.returncode == 1
    assert "checkpoint-5: no model weights found (model.safetensors is not listed)" in r.stderr
    model_only = make_ckpt(tmp_path / "b", 6)
    r = rtrain("export", str(model_only), str(tmp_path / "w.safetensors"), "--optimizer")
    assert r.returncode == 1
    assert "checkpoint-6: holds no optimizer state to export: leave out --optimizer" in r.stderr
    assert leftovers(tmp_path) == []


# ----------------------------------------------------------------- a Trainer's safetensors

def test_trainer_dir_safetensors_and_shards_are_copied_bitwise(rtrain, tmp_path):
    g = torch.Generator().manual_seed(1)
    whole = {"w": torch.randn(8, 4, generator=g), "b": torch.arange(3, dtype=torch.int64),
             "h": torch.randn(5, generator=g).to(torch.bfloat16)}
    for name, shards in (("checkpoint-4", None), ("checkpoint-8", [["w"], ["b", "h"]])):
        d = tmp_path / "out" / name
        d.mkdir(parents=True)
        if shards is None:
            save_file(whole, str(d / "model.safetensors"))
        else:
            weight_map = {}
            for i, keys in enumerate(shards):
                shard = f"model-0000{i + 1}-of-00002.safetensors"
                save_file({k: whole[k] for k in keys}, str(d / shard))
                weight_map.update({k: shard for k in keys})
            (d / "model.safetensors.index.json").write_text(json.dumps(
                {"weight_map": weight_map}))
        (d / "trainer_state.json").write_text(json.dumps({"global_step": int(name[11:])}))
        out = tmp_path / f"{name}.safetensors"
        r = rtrain("export", str(d), str(out))
        assert r.returncode == 0, r.stderr
        assert f"of {name} (hf-trainer, step {name[11:]}, verified full)" in r.stdout
        got = load_file(str(out))
        assert sorted(got) == sorted(whole)
        for k in whole:
            assert bitwise(got[k], whole[k])
    r = rtrain("export", str(tmp_path / "out" / "checkpoint-4"), str(tmp_path / "o.safetensors"),
               "--optimizer")
    assert r.returncode == 1 and "no optimizer.pt" in r.stderr


# ----------------------------------------------------------------- the torch side, in-process

def request(path: Path, out: Path, source: str = "pickle", **kw) -> dict:
    return {"source": source, "path": str(path), "out": str(out), "format": "torch",
            "optimizer": False, "metadata": {"format": "pt"}, **kw}


def evil_pickle(marker: Path) -> bytes:
    """GLOBAL os.system, its argument, REDUCE: unpickled, it creates `marker`."""
    cmd = f"touch {marker}".encode()
    return (b"\x80\x02cos\nsystem\nq\x00X" + len(cmd).to_bytes(4, "little") + cmd
            + b"q\x01\x85q\x02Rq\x03.")


def evil_files(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A torch.save zip whose data.pkl is the evil pickle, and the same pickle bare (the
    legacy format): both pass rtrain's structural check, so only the loader stands between."""
    import zipfile

    marker = tmp_path / "pwned"
    zipped = tmp_path / "evil" / "ckpt.pt"
    zipped.parent.mkdir()
    with zipfile.ZipFile(zipped, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", evil_pickle(marker))
        z.writestr("archive/version", "3\n")
    legacy = tmp_path / "legacy" / "old.pt"
    legacy.parent.mkdir()
    legacy.write_bytes(evil_pickle(marker))
    return marker, [zipped, legacy]


def test_a_malicious_pickle_is_refused_and_never_run(tmp_path):
    marker, files = evil_files(tmp_path)
    for path in files:
        with pytest.raises(CheckpointError) as e:
            wexport.export(request(path, tmp_path / "out.pt"))
        assert str(e.value) == (f"{path.name}: refused by torch.load(weights_only=True), "
                                "nothing in it was run: Trying to load unsupported GLOBAL "
                                "os.system whose module os is blocked.")
        assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_rtrain_format_to_torch_in_process_is_the_optimizers_own_state_dict(tmp_path):
    model, opt, path = trained(tmp_path)
    out = tmp_path / "out.pt"
    assert wexport.export(request(path, out, source="rtrain", optimizer=True))["tensors"] == 16
    got = torch.load(out, weights_only=True)
    same_state_dict(got["model"], model.state_dict())
    want = opt.state_dict()
    assert got["optimizer"]["param_groups"] == want["param_groups"]
    assert got["optimizer"]["param_groups"][0]["betas"] == (0.8, 0.95)
    for i, st in want["state"].items():
        assert list(got["optimizer"]["state"][i]) == list(st)
        for key, t in st.items():
            assert bitwise(got["optimizer"]["state"][i][key], t), (i, key)


def test_lightning_and_torch_save_layouts_in_process(tmp_path):
    torch.manual_seed(3)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sd, osd = model.state_dict(), opt.state_dict()
    cases = {"last.ckpt": {"state_dict": sd, "optimizer_states": [osd], "global_step": 7},
             "ckpt.pt": {"model": sd, "optimizer": osd, "iter_num": 7},
             "plain.pt": dict(sd)}
    for name, obj in cases.items():
        torch.save(obj, tmp_path / name)
        out = tmp_path / f"{name}.out.pt"
        want_opt = name != "plain.pt"
        result = wexport.export(request(tmp_path / name, out, optimizer=want_opt))
        got = torch.load(out, weights_only=True)
        model_sd = got["model"] if want_opt else got
        same_state_dict(model_sd, sd)
        if want_opt:
            assert got["optimizer"]["param_groups"] == osd["param_groups"]
            assert bitwise(got["optimizer"]["state"][0]["momentum_buffer"],
                           osd["state"][0]["momentum_buffer"])
        assert result["tensors"] == (4 if want_opt else 2)
    st = tmp_path / "ckpt.safetensors"
    wexport.export({**request(tmp_path / "ckpt.pt", st, optimizer=True), "format": "safetensors"})
    got = load_file(str(st))
    assert bitwise(got["weight"], sd["weight"])
    assert bitwise(got["optimizer/0/momentum_buffer"], osd["state"][0]["momentum_buffer"])
    torch.save({"epoch": 3, "note": "no tensors"}, tmp_path / "odd.pt")
    with pytest.raises(CheckpointError, match=re.escape(
            "odd.pt: no model weights found: not a dict of tensors, and none under "
            "'state_dict', 'model_state_dict', 'model' (its keys: 'epoch', 'note')")):
        wexport.export(request(tmp_path / "odd.pt", tmp_path / "odd.out"))
    with pytest.raises(CheckpointError, match=r"plain\.pt: holds no optimizer state"):
        wexport.export(request(tmp_path / "plain.pt", tmp_path / "p2.pt", optimizer=True))


# ----------------------------------------------------------------- real processes

@pytest.mark.slow
def test_rtrain_checkpoint_to_torch_with_optimizer_loads_into_a_fresh_model_bitwise(tmp_path):
    model, opt, path = trained(tmp_path, steps=4)
    out = tmp_path / "export.pt"
    r = run_rtrain("export", str(path), str(out), "--optimizer", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "exported the model weights and optimizer state of checkpoint-4" in r.stdout
    got = torch.load(out, weights_only=True)
    same_state_dict(got["model"], model.state_dict())
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=5.0)
    fresh.load_state_dict(got["model"])
    fresh_opt.load_state_dict(got["optimizer"])
    want, have = opt.state_dict(), fresh_opt.state_dict()
    assert have["param_groups"] == want["param_groups"]
    for i, st in want["state"].items():
        for key, t in st.items():
            assert bitwise(have["state"][i][key], t), (i, key)
    plain = tmp_path / "weights.pth"
    r = run_rtrain("export", str(tmp_path / "ckpt"), str(plain), cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    same_state_dict(torch.load(plain, weights_only=True), model.state_dict())
    assert oct(plain.stat().st_mode & 0o777) == oct((path / "model.safetensors").stat().st_mode
                                                    & 0o666)


@pytest.mark.slow
def test_malicious_pickles_are_refused_by_the_command_and_never_run(rtrain, tmp_path):
    marker, files = evil_files(tmp_path)
    for path in files:
        for out in ("out.pt", "out.safetensors"):
            r = rtrain("export", str(path), str(tmp_path / out))
            assert r.returncode == 1, r.stdout
            # Refused by rtrain's own verification, before any torch.load (the walk of the
            # pickle's opcodes names what it would call); the worker's weights_only load is the
            # second line (tests above, in-process).
            assert r.stderr.startswith(f"rtrain: error: {path.name} failed full verification: "
                                       "corrupt: "), r.stderr
            assert r.stderr.endswith("the pickle calls os.system when loaded, which no "
                                     "checkpoint format rtrain resumes from writes (refused, "
                                     "never run); not exported\n"), r.stderr
            assert not marker.exists() and not (tmp_path / out).exists()
    assert leftovers(tmp_path) == []


@pytest.mark.slow
def test_lightning_ckpt_and_trainer_bin_through_the_command(rtrain, tmp_path):
    torch.manual_seed(5)
    model = nn.Linear(6, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    (tmp_path / "pl").mkdir()
    torch.save({"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()],
                "epoch": 0, "global_step": 12}, tmp_path / "pl" / "epoch=0-step=12.ckpt")
    r = rtrain("export", str(tmp_path / "pl"), str(tmp_path / "pl.safetensors"), "--optimizer")
    assert r.returncode == 0, r.stderr
    assert "of epoch=0-step=12.ckpt (lightning, step 12, verified full)" in r.stdout
    assert "note: model weights from its 'state_dict' entry" in r.stdout
    got = load_file(str(tmp_path / "pl.safetensors"))
    same_state_dict({k: got[k] for k in ("weight", "bias")}, model.state_dict())
    assert bitwise(got["optimizer/1/exp_avg_sq"], opt.state_dict()["state"][1]["exp_avg_sq"])

    hf = tmp_path / "hf" / "checkpoint-20"
    hf.mkdir(parents=True)
    torch.save(model.state_dict(), hf / "pytorch_model.bin")
    torch.save(opt.state_dict(), hf / "optimizer.pt")
    torch.save({"last_epoch": 20}, hf / "scheduler.pt")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 20}))
    r = rtrain("export", str(hf), str(tmp_path / "hf.pt"), "--optimizer")
    assert r.returncode == 0, r.stderr
    got = torch.load(tmp_path / "hf.pt", weights_only=True)
    same_state_dict(got["model"], model.state_dict())
    assert got["optimizer"]["param_groups"] == opt.state_dict()["param_groups"]


@pytest.mark.slow
def test_the_safetensors_export_of_rtrains_format_never_imports_torch(tmp_path, make_ckpt):
    path = make_ckpt(tmp_path / "ckpt", 100)
    code = ("import sys\nfrom rtrain.supervisor.cli import main\n"
            "sys.argv = ['rtrain', 'export', sys.argv[1], sys.argv[2], '--format', "
            "'safetensors']\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRAIN_")}
    r = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "w.st")],
                       capture_output=True, text=True, env=env, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert int(load_file(str(tmp_path / "w.st"))["step"]) == 100
