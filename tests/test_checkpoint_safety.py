"""Checkpoint safety: a save writes only into a checkpoint of ours (or an empty directory) and deletes only
files a manifest of ours names; its I/O errors name the file; a load never sees a checkpoint a save is
replacing."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest
import torch
from helpers import HOLD, REPO, SMALL, THREE_SIZES, make_params, python_env, train

from offload import CheckpointError, OffloadedAdamW, save_parameters
from offload import checkpoint as ckpt
from offload.checkpoint import commit
from offload.checkpoint.format import MANIFEST


def tree(root) -> dict:
    """Every path under ``root`` (itself included) with its kind and content: a file's bytes, a
    link's target. Links are not followed."""
    root = os.fspath(root)
    out = {}

    def visit(path, rel):
        if os.path.islink(path):
            out[rel] = ("link", os.readlink(path))
        elif os.path.isdir(path):
            out[rel] = ("dir",)
            for n in os.listdir(path):
                visit(os.path.join(path, n), os.path.join(rel, n))
        else:
            with open(path, "rb") as f:
                out[rel] = ("file", f.read())

    if os.path.lexists(root):
        visit(root, ".")
    return out


def leftovers(*dirs) -> list[str]:
    """Anything beside the checkpoints in these directories (a save writes only inside its own)."""
    return [n for d in dirs for n in os.listdir(d) if "." in n]


def on_disk(manifest: dict) -> list[str]:
    """The files a checkpoint directory holds: its manifest and the files the manifest names."""
    return sorted([MANIFEST, *(e.get("file", n) for n, e in manifest["files"].items())])


# -- what a save may replace ------------------------------------------------------------------------

REFUSED = ["cwd", "run-folder", "nvme-path", "file", "link-to-dir", "foreign-manifest", "corrupt-manifest"]


def make_refused(kind: str, home, make_checkpoint) -> tuple[str, str, str]:
    """Build a target a save must refuse under ``home``; returns (path to save to, working directory,
    the path the error must name)."""
    home.mkdir(exist_ok=True)
    if kind == "cwd":  # save_checkpoint(".") from a working directory
        d = home / "work"
        (d / "data").mkdir(parents=True)
        (d / "notes.txt").write_text("my notes\n")
        (d / ".bashrc").write_text("export X=1\n")
        (d / "data" / "x.bin").write_bytes(os.urandom(5000))
        return ".", str(d), str(d)
    if kind == "run-folder":
        d = home / "run"
        (d / "logs").mkdir(parents=True)
        (d / "train.py").write_text("print('training')\n")
        (d / "config.yaml").write_text("lr: 0.001\n")
        (d / "logs" / "events.txt").write_text("step 1\n")
        return str(d), str(home), str(d)
    if kind == "nvme-path":  # another process's live swap file
        d = home / "nvme"
        d.mkdir()
        (d / "host-4242-rank0.swap").write_bytes(os.urandom(64 * 1024))
        return str(d), str(home), str(d)
    if kind == "file":
        f = home / "weights.bin"
        f.write_bytes(os.urandom(3000))
        return str(f), str(home), str(f)
    if kind == "link-to-dir":
        plain = home / "plain"
        plain.mkdir()
        (plain / "keep.txt").write_text("keep me\n")
        os.symlink("plain", home / "link")
        return str(home / "link"), str(home), str(home / "link")
    if kind == "foreign-manifest":  # another tool's directory that also names a file manifest.json
        d = home / "other"
        d.mkdir()
        (d / MANIFEST).write_text(json.dumps({"format": "some-other-tool", "files": {}}))
        (d / "payload.bin").write_bytes(os.urandom(2000))
        return str(d), str(home), str(d)
    d = home / "ckpt"
    make_checkpoint(d)
    manifest = json.loads((d / MANIFEST).read_text())  # corrupt-manifest: its file list cannot be trusted
    manifest["step"] = 12345
    (d / MANIFEST).write_text(json.dumps(manifest))
    return str(d), str(home), str(d)


def weights_checkpoint(path) -> None:
    save_parameters(torch.nn.Linear(16, 8), path)


@pytest.fixture
def saver(request, tmp_path):
    """A save function of one of the public save paths, ``save(target)``."""
    if request.param == "save_checkpoint":
        params = make_params(THREE_SIZES)
        opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
        train(opt, params, range(1))
        yield lambda target: ckpt.save_checkpoint(opt, target, extra={"step": 1})
        opt.close()
    elif request.param == "save_parameters":
        model = torch.nn.Linear(16, 8)
        yield lambda target: save_parameters(model, target)
    else:
        state = adamw_state_dict()
        yield lambda target: ckpt.import_state_dict(state, target)


def adamw_state_dict() -> dict:
    """torch.optim.AdamW's state_dict after one step on a small model (what ``import`` reads)."""
    model = torch.nn.Linear(16, 8)
    adam = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    adam.step()
    return adam.state_dict()


SAVERS = ["save_checkpoint", "save_parameters", "import_state_dict"]


@pytest.mark.parametrize("saver", SAVERS, indirect=True)
@pytest.mark.parametrize("kind", REFUSED)
def test_a_save_refuses_whatever_is_not_a_checkpoint_and_touches_nothing(tmp_path, monkeypatch, saver, kind):
    """Saving onto a directory that is not one of our checkpoints (cwd, a run folder, an nvme_path,
    a link to one), a file, or a checkpoint with a corrupt manifest, raises
    FileExistsError naming it before anything is written; every user file stays byte for byte."""
    home = tmp_path / "home"
    target, cwd, named = make_refused(kind, home, weights_checkpoint)
    monkeypatch.chdir(cwd)
    before = tree(home)
    with pytest.raises(FileExistsError) as info:
        saver(target)
    assert info.value.filename == named and named in str(info.value)
    assert "remove" in str(info.value)
    assert tree(home) == before


def test_saving_into_the_optimizers_own_nvme_path_is_refused_and_the_swap_file_survives(tmp_path, nvme):
    """save_checkpoint(opt, nvme_path) is refused: the live swap file is byte for byte the same and
    the optimizer goes on stepping as if nothing had happened."""
    params = make_params(THREE_SIZES)
    ref = make_params(THREE_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    ref_opt = OffloadedAdamW(ref, lr=1e-2, nvme_path=str(tmp_path / "ref"), **SMALL)
    try:
        train(opt, params, range(2))
        train(ref_opt, ref, range(2))
        before = tree(nvme)
        assert any(n.endswith(".swap") for n in os.listdir(nvme))
        with pytest.raises(FileExistsError, match="not an nvme-offload checkpoint"):
            ckpt.save_checkpoint(opt, nvme)
        assert tree(nvme) == before
        train(opt, params, range(2, 4))
        train(ref_opt, ref, range(2, 4))
        for p, q in zip(params, ref):
            assert torch.equal(p, q)
    finally:
        opt.close()
        ref_opt.close()


@pytest.mark.parametrize("saver", SAVERS, indirect=True)
def test_an_empty_directory_becomes_the_checkpoint(tmp_path, saver):
    """An empty directory is used as the target (nothing to lose): it becomes a complete checkpoint,
    and nothing is left beside it."""
    target = tmp_path / "empty"
    target.mkdir()
    saver(target)
    manifest = ckpt.verify_checkpoint(target)
    assert sorted(os.listdir(target)) == on_disk(manifest)
    assert not leftovers(tmp_path)


@pytest.mark.parametrize("saver", SAVERS, indirect=True)
def test_a_checkpoint_is_replaced_by_its_next_save_and_a_users_file_in_it_stays(tmp_path, saver):
    """Saving over a checkpoint of ours replaces its files with the new save's (the ordinary re-save
    still works): a file of the user's inside it, and one beside it, stay byte for byte."""
    saver(tmp_path / "c")
    first = ckpt.read_manifest(tmp_path / "c")
    (tmp_path / "c" / "README.txt").write_text("what this run was\n")
    (tmp_path / "c.txt").write_text("beside it\n")
    saver(tmp_path / "c")
    second = ckpt.verify_checkpoint(tmp_path / "c")
    assert not set(on_disk(first)) - {MANIFEST} & set(on_disk(second))  # every file is new
    assert sorted(os.listdir(tmp_path / "c")) == sorted([*on_disk(second), "README.txt"])
    assert (tmp_path / "c" / "README.txt").read_text() == "what this run was\n"
    assert (tmp_path / "c.txt").read_text() == "beside it\n"


@pytest.mark.parametrize("saver", SAVERS, indirect=True)
def test_a_link_to_a_checkpoint_is_followed_and_stays_a_link(tmp_path, saver):
    """Saving to a symbolic link to a checkpoint replaces the checkpoint it points to: the link stays
    a link to the same place, and nothing is left beside either."""
    (tmp_path / "runs").mkdir()
    real = tmp_path / "runs" / "real"
    weights_checkpoint(real)
    old = ckpt.read_manifest(real)
    link = tmp_path / "latest"
    os.symlink(os.path.join("runs", "real"), link)
    assert saver(link) == str(link)
    assert os.path.islink(link) and os.readlink(link) == os.path.join("runs", "real")
    new = ckpt.verify_checkpoint(real)
    assert new["files"] != old["files"]
    assert sorted(os.listdir(real)) == on_disk(new)
    assert not leftovers(tmp_path / "runs")


def test_what_a_dead_save_left_is_removed_and_nothing_else(tmp_path):
    """Files of a generation's name that no manifest names (what a save that died left) are removed by
    the next save of that directory; a user's file there, and any name of another shape, stay."""
    save_parameters(torch.nn.Linear(16, 8), tmp_path / "c")
    dead = ["params.0123456789abcdef.bin", "manifest.0123456789abcdef.json", "model.fedcba9876543210.pt"]
    for name in dead:
        (tmp_path / "c" / name).write_bytes(b"\0" * 4096)
    mine = ["params.bin.bak", "state.0123.bin", "notes.txt"]
    for name in mine:
        (tmp_path / "c" / name).write_text("mine\n")
    save_parameters(torch.nn.Linear(16, 8), tmp_path / "c")
    manifest = ckpt.verify_checkpoint(tmp_path / "c")
    assert sorted(os.listdir(tmp_path / "c")) == sorted([*on_disk(manifest), *mine])


# -- offload-ckpt import -----------------------------------------------------------------------------


def test_cli_import_refuses_whatever_is_not_a_checkpoint_and_fills_an_empty_directory(tmp_path, monkeypatch, capsys):
    """``offload-ckpt import X.pt DIR`` with DIR ``.`` in a working directory, a run folder, an
    nvme_path or a link to a directory exits 1 with an error naming it, every user file byte for byte
    as it was; into an empty directory it writes a checkpoint. The refusals run the command's main in this
    process; the import into the empty directory runs as the command, in a process of its own."""
    from offload.tools.ckpt_cli import main as ckpt_main

    state = tmp_path / "adamw.pt"
    torch.save(adamw_state_dict(), state)
    (tmp_path / "empty").mkdir()
    empty = subprocess.Popen([sys.executable, "-m", "offload.tools.ckpt_cli", "import", str(state),
                              str(tmp_path / "empty")], cwd=str(tmp_path), env=python_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        for kind in ("cwd", "run-folder", "nvme-path", "link-to-dir"):
            home = tmp_path / kind
            target, cwd, named = make_refused(kind, home, weights_checkpoint)
            before = tree(home)
            with monkeypatch.context() as m:
                m.chdir(cwd)
                code = ckpt_main(["import", str(state), target])
            err = capsys.readouterr().err
            assert code == 1, f"{kind}: {err}"
            assert named in err and "remove" in err and "Errno" not in err, f"{kind}: {err}"
            assert tree(home) == before, kind
    finally:
        out, err = empty.communicate(timeout=120)
    assert empty.returncode == 0, err
    ckpt.verify_checkpoint(tmp_path / "empty")
    assert leftovers(tmp_path) == ["adamw.pt"]


# -- a full disk: errors that name the file ----------------------------------------------------------


def assert_names_the_file(err: OSError, target, name: str) -> None:
    """``err`` is ENOSPC as ``OSError(errno, message, path)`` naming ``name`` in the save of ``target``,
    with the original error chained (not torch's RuntimeError)."""
    assert type(err) is OSError and err.errno == errno.ENOSPC and err.filename, repr(err)
    stem, ext = os.path.splitext(name)
    assert re.fullmatch(rf"{stem}\.[0-9a-f]{{16}}{ext}", os.path.basename(err.filename)), err.filename
    assert err.filename.startswith(str(target)), err.filename
    assert stem in str(err) and "No space left" in str(err)
    assert isinstance(err.__cause__, OSError) and err.__cause__.errno == errno.ENOSPC


@pytest.mark.parametrize("name", ["memory.pt", "extra.pt"])
def test_a_full_disk_on_a_side_file_names_it_and_keeps_the_previous_checkpoint(tmp_path, tmpfs, name):
    """ENOSPC on memory.pt or extra.pt (state.bin fits) is an OSError with errno and the file's path,
    not torch's RuntimeError; no staged directory is left and the previous checkpoint is intact."""
    mnt = tmpfs("1200k")
    if name == "memory.pt":  # all state in memory.pt: 800 KB, twice does not fit
        params = make_params((100_000,))
        opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **{**SMALL,
                             "small_param_threshold": 10 ** 9})
        extra = None
    else:  # 160 KB of state in state.bin, and an extra of 1 MiB
        params = make_params((20_000,))
        opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
        extra = {"blob": torch.zeros(1 << 18)}
    try:
        train(opt, params, range(1))
        target = mnt / "c"
        ckpt.save_checkpoint(opt, target)
        before = tree(mnt)
        train(opt, params, range(1, 2))
        with pytest.raises(OSError) as info:
            ckpt.save_checkpoint(opt, target, extra=extra)
        assert_names_the_file(info.value, target, name)
        assert tree(mnt) == before
        ckpt.verify_checkpoint(target)
    finally:
        opt.close()


def test_a_full_disk_on_model_pt_names_it_and_keeps_the_previous_checkpoint(tmpfs):
    """ENOSPC on model.pt (save_parameters of a model kept in memory) names model.pt with its errno;
    the previous checkpoint is intact and nothing else is left."""
    mnt = tmpfs("400k")
    model = torch.nn.Linear(256, 256)  # 257 KiB of weights: twice does not fit
    save_parameters(model, mnt / "w")
    before = tree(mnt)
    with pytest.raises(OSError) as info:
        save_parameters(model, mnt / "w")
    assert_names_the_file(info.value, mnt / "w", "model.pt")
    assert tree(mnt) == before
    ckpt.verify_checkpoint(mnt / "w")


def test_a_full_disk_on_the_manifest_names_it_and_keeps_the_previous_checkpoint(tmp_path, tmpfs):
    """ENOSPC on manifest.json alone (every data file fits, to the page) names manifest.json with its
    errno; the previous checkpoint is intact and nothing else is left."""
    mnt = tmpfs("2m")
    params = make_params((20_000, 30))
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
    try:
        train(opt, params, range(1))
        target = mnt / "c"
        ckpt.save_checkpoint(opt, target, extra={"step": 1})
        # Fill the disk so that what the next save needs for its data files is left, and no more.
        data = sum(os.stat(target / n).st_blocks * 512 for n in os.listdir(target) if n != MANIFEST)
        st = os.statvfs(mnt)
        with open(mnt / "filler", "wb") as f:
            os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize - data)
        before = tree(mnt)
        train(opt, params, range(1, 2))
        with pytest.raises(OSError) as info:
            ckpt.save_checkpoint(opt, target, extra={"step": 2})
        assert_names_the_file(info.value, target, MANIFEST)
        assert tree(mnt) == before
        assert ckpt.verify_checkpoint(target)["step"] == 1
    finally:
        opt.close()


# -- loads racing saves --------------------------------------------------------------------------------

SAVER = textwrap.dedent("""
    import sys
    import torch
    from offload import OffloadedAdamW
    from offload.checkpoint import save_checkpoint

    target, nvme, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 5000, 70_000, 300_001)]
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, buffer_size=256 * 1024, buffer_count=3,
                         small_param_threshold=64)
    for k in range(1, count + 1):
        for p in params:
            p.grad = torch.randn(p.shape)
        opt.step()
        save_checkpoint(opt, target, extra={"step": k})
        print(k, flush=True)
    opt.close()
""")


def test_loads_racing_another_processs_saves_see_whole_checkpoints(tmp_path, nvme):
    """While another process saves the same checkpoint over and over (new state each time), every
    verify and every load held under ``reading`` succeeds with one whole, self-consistent checkpoint:
    never a checksum error or a missing file."""
    target = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(target), str(tmp_path / "saver-nvme"), "20"],
                            cwd=REPO, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 5000, 70_000, 300_001)]
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=nvme, **SMALL)
    try:
        assert proc.stdout.readline().strip() == "1", proc.stderr.read()
        loads = verifies = 0
        while proc.poll() is None:
            ckpt.verify_checkpoint(target)
            verifies += 1
            with commit.reading(target):
                extra = ckpt.load_checkpoint(opt, target)
            loads += 1
            steps = {float(s["step"]) for s in opt.state_dict()["state"].values()}
            assert steps == {float(extra["step"])}, (steps, extra)
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
        assert loads and verifies
        assert ckpt.verify_checkpoint(target)["step"] == 20
    finally:
        proc.kill()
        proc.wait()
        opt.close()


def test_a_reader_that_cannot_wait_says_a_save_is_in_progress(tmp_path):
    """``reading(dir, timeout=...)`` while another process's save holds the directory's lock raises a
    CheckpointError saying a save is in progress, instead of reading a checkpoint being replaced."""
    weights_checkpoint(tmp_path / "c")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "c")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ckpt.CheckpointError, match="save into .* is in progress"):
            with commit.reading(tmp_path / "c", timeout=0.2):
                pass
    finally:
        holder.kill()
        holder.wait()
    with commit.reading(tmp_path / "c", timeout=0.2):
        ckpt.verify_checkpoint(tmp_path / "c")


def test_reads_inside_a_save_of_the_same_thread_do_not_wait_for_it(tmp_path):
    """A checkpoint read while this same thread saves into another directory beside it goes on at once;
    a save into a directory inside this thread's ``reading`` of it is refused with an error instead of
    hanging."""
    weights_checkpoint(tmp_path / "a")
    model = torch.nn.Linear(16, 8)
    result = {}

    def save_b_reading_a():
        def write(staged):
            result["a"] = ckpt.verify_checkpoint(tmp_path / "a")["files"]
            return _manifest_of(model, staged)

        try:
            commit.write_atomically(tmp_path / "b", write)
        except BaseException as err:  # reported below
            result["error"] = err

    worker = threading.Thread(target=save_b_reading_a, daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "a read inside a save waited for the save's own lock"
    assert "error" not in result, result.get("error")
    assert result["a"] and ckpt.verify_checkpoint(tmp_path / "b")
    with commit.reading(tmp_path / "b"):
        with pytest.raises(ckpt.CheckpointError, match="while this thread is reading"):
            save_parameters(model, tmp_path / "b")
    ckpt.verify_checkpoint(tmp_path / "b")


def _manifest_of(model, staged):
    """What a weights-only save writes into ``staged``, as its ``write`` returns it."""
    from offload.checkpoint.manifest import Manifest
    from offload.checkpoint.model import save_model

    section, files = save_model(model, staged)
    return Manifest.new(None, files=files, config={}, model=section)


# -- retention ----------------------------------------------------------------------------------------


def test_retention_never_deletes_what_is_not_ours(tmp_path):
    """Pruning under a root that also holds another tool's ``step-<n>`` directory (with a
    manifest.json of its own) and a foreign directory named like an interrupted deletion deletes none
    of them; our own old checkpoints go, and a user's file inside one stays where it was."""
    root = tmp_path / "ckpts"
    root.mkdir()
    foreign = root / "step-1"
    foreign.mkdir()
    (foreign / MANIFEST).write_text(json.dumps({"format": "another-tool", "step": 1}))
    (foreign / "weights.safetensors").write_bytes(os.urandom(1000))
    (root / "step-3.tmp-del-0badf00d").mkdir()
    (root / "step-3.tmp-del-0badf00d" / "results.csv").write_text("a,b\n")
    kept = {n: tree(root / n) for n in ("step-1", "step-3.tmp-del-0badf00d")}
    params = make_params(THREE_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
    try:
        keep = ckpt.Retention(root, keep_last=1)
        train(opt, params, range(1))
        annotated = keep.save(opt, 2)
        with open(os.path.join(annotated, "notes.txt"), "w") as f:
            f.write("the good run\n")
        for step in range(4, 7):
            train(opt, params, range(step - 1, step))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # "not deleting ...": the point of the test
                keep.save(opt, step)
        assert {n: tree(root / n) for n in kept} == kept
        assert keep.checkpoints() == [keep.path_for(6)]  # 2, 4 and 5, ours, were deleted
        assert tree(annotated) == {".": ("dir",), "./notes.txt": ("file", b"the good run\n")}
        assert not [n for n in os.listdir(root) if n.startswith("step-0") and ".tmp-" in n]
    finally:
        opt.close()


def test_checkpoints_and_their_copies_are_the_owners_alone(tmp_path):
    """Optimizer state and weights are the user's data: every file a save writes (data, memory.pt, model.pt,
    extra.pt, the manifest) is 0600 and a new checkpoint directory 0700, whatever the umask allows; a mirror
    copy never widens that."""
    model = torch.nn.Linear(64, 64)
    params = list(model.parameters())
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
    old = os.umask(0o022)
    try:
        train(opt, params, range(1))
        ckpt.save_checkpoint(opt, tmp_path / "c", model=model, extra={"step": 1})
        ckpt.mirror_checkpoint(tmp_path / "c", tmp_path / "copy")
    finally:
        os.umask(old)
        opt.close()
    checked = 0
    for top in (tmp_path / "c", tmp_path / "copy"):
        assert os.stat(top).st_mode & 0o777 == 0o700, top
        for name in os.listdir(top):
            mode = os.stat(os.path.join(top, name)).st_mode & 0o777
            assert mode == 0o600, f"{top}/{name} is {mode:o}"
            checked += 1
    assert checked >= 10


def test_offload_file_mode_widens_to_readers_and_a_copy_never_widens_its_original(tmp_path, monkeypatch):
    """OFFLOAD_FILE_MODE=0640 lets the group read what is saved from then on (files 0640, directories 0750, the
    swap file too), still under the umask; a mirror of a checkpoint saved 0600 stays 0600; a mode that would let
    others write, or drop the owner's access, or is not octal is refused naming the variable."""
    from offload.modes import ENV, dir_mode, file_mode
    from offload.pretrained import save_pretrained

    def modes(top):
        return os.stat(top).st_mode & 0o777, {os.stat(top / n).st_mode & 0o777 for n in os.listdir(top)}

    model = torch.nn.Linear(64, 64)
    params = list(model.parameters())
    old = os.umask(0o022)
    try:
        opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
        try:
            train(opt, params, range(1))
            ckpt.save_checkpoint(opt, tmp_path / "private", model=model)
            monkeypatch.setenv(ENV, "0640")
            ckpt.mirror_checkpoint(tmp_path / "private", tmp_path / "copy")
            ckpt.save_checkpoint(opt, tmp_path / "shared", model=model)
            other = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap2"), **SMALL)
            try:
                train(other, params, range(1))
                assert modes(tmp_path / "swap2")[1] == {0o640}
            finally:
                other.close()
        finally:
            opt.close()
        save_pretrained(model, tmp_path / "hf-shared")  # a Hugging Face save too
        monkeypatch.setenv(ENV, "0644")
        os.umask(0o027)  # the umask still narrows
        ckpt.mirror_checkpoint(tmp_path / "shared", tmp_path / "narrowed")
        os.umask(0o077)
        save_pretrained(model, tmp_path / "hf-private")
    finally:
        os.umask(old)
    assert modes(tmp_path / "private") == (0o700, {0o600})
    assert modes(tmp_path / "copy") == (0o750, {0o600})  # the new directory, but no file wider than its original
    assert modes(tmp_path / "shared") == (0o750, {0o640})
    assert modes(tmp_path / "narrowed") == (0o750, {0o640})
    assert modes(tmp_path / "hf-shared") == (0o750, {0o640})
    assert modes(tmp_path / "hf-private") == (0o700, {0o600})
    assert (file_mode(), dir_mode()) == (0o644, 0o755)
    for bad in ("0660", "0400", "0666", "rw-r-----", "0o640x", "01640"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            file_mode()
    monkeypatch.setenv(ENV, "0640")
    with pytest.raises(ValueError, match="0600 to 0644"):
        monkeypatch.setenv(ENV, "0606")
        file_mode()


def test_a_link_planted_at_a_milestone_marker_is_refused_and_its_target_untouched(tmp_path):
    """Another user plants ``step-<n>.keep`` as a link to a file of the victim's in a shared root: the
    milestone save refuses to mark it (CheckpointError saying what to remove) and never writes through it;
    the checkpoint itself is saved."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    root = tmp_path / "root"
    root.mkdir()
    params = make_params(THREE_SIZES)
    opt = OffloadedAdamW(params, lr=1e-2, nvme_path=str(tmp_path / "swap"), **SMALL)
    try:
        keep = ckpt.Retention(root, keep_last=1)
        os.symlink(victim, keep.path_for(3) + ".keep")
        train(opt, params, range(1))
        with pytest.raises(CheckpointError, match=r"not a plain file.*Remove it"):
            keep.save(opt, 3, milestone=True)
        assert victim.read_text() == "precious\n"
        assert ckpt.verify_checkpoint(keep.path_for(3))
        keep.save(opt, 4, milestone=True)  # an honest marker: a plain file, durably there
        assert os.path.isfile(keep.path_for(4) + ".keep") and not os.path.islink(keep.path_for(4) + ".keep")
    finally:
        opt.close()
