"""Nothing lost: every command that writes a directory refuses to overwrite its inputs and a
user's files, writes into OUT.incomplete/ until it finishes, and leaves nothing that loads when
it is interrupted. First output_dir.py itself, then the commands that use it (train, distill,
bench), each on the cases that used to lose data."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers import save_tiny_model, stdlib_corpus
from specdec.cli import main
from specdec.models.checkpoint import save_pretrained
from specdec.models.loader import ModelLoadError, load_pretrained
from specdec.output_dir import STAGING_MARKER, check_written_in_place, open_output_dir, staging_path
from specdec.tools.training import loop
from specdec.tools.training.train import model_shape, new_model

TINY_RUN = [
    "--preset",
    "tiny",
    "--context",
    "32",
    "--batch-size",
    "4",
    "--warmup",
    "1",
    "--eval-tokens",
    "256",
    "--log-every",
    "0",
    "--eval-every",
    "0",
    "--device",
    "cpu",
]


def snapshot(path: Path) -> dict[str, bytes]:
    """Every file under path, by relative name, with its bytes."""
    return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def model_dir(corpus_dir, tmp_path_factory) -> Path:
    """A tiny model made by `specdec train` (its model card and training log included)."""
    out = tmp_path_factory.mktemp("made") / "target"
    assert main(["train", "--corpus", str(corpus_dir), "--out", str(out), *TINY_RUN, "--steps", "2"]) == 0
    return out


def user_folder(path: Path) -> Path:
    """A user's own folder, named like a model's files."""
    path.mkdir(parents=True)
    (path / "README.md").write_text("my notes\n")
    (path / "config.json").write_text('{"mine": true}\n')
    (path / "tokenizer.json").write_text("{}\n")
    return path


# ---------------------------------------------------------------------------- output_dir.py


@pytest.mark.parametrize("out", ["", "   ", None])
def test_an_empty_out_is_refused(out, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--out is empty"):
        open_output_dir(out, "train")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "where, relation", [("same", "is"), ("inside", "lies inside"), ("parent", "holds"), ("link", "is")]
)
def test_an_out_overlapping_an_input_is_refused_even_with_force(where, relation, tmp_path):
    source = user_folder(tmp_path / "models" / "target")
    out = {"same": source, "inside": source / "sub", "parent": tmp_path / "models", "link": tmp_path / "link"}[where]
    if where == "link":
        out.symlink_to(source)
    before = snapshot(tmp_path / "models")
    with pytest.raises(ValueError, match=f"{relation} --target '{source}'"):
        open_output_dir(out, "distill", {"--target": source, "--init": None}, force=True)
    assert snapshot(tmp_path / "models") == before
    assert not staging_path(out).exists()


def test_a_folder_of_other_files_is_refused_then_replaced_only_when_forced_and_finished(tmp_path):
    folder = user_folder(tmp_path / "mine")
    before = snapshot(folder)
    with pytest.raises(ValueError, match=r"already holds files \(README.md, config.json, tokenizer.json\) .*--force"):
        open_output_dir(folder, "train")
    assert snapshot(folder) == before and not staging_path(folder).exists()

    output = open_output_dir(folder, "train", force=True)
    (output.staging / "model.safetensors").write_bytes(b"new")
    assert snapshot(folder) == before  # nothing replaced before the run finishes
    assert output.commit() == folder.resolve()
    assert snapshot(folder) == {"model.safetensors": b"new"}
    assert not output.staging.exists() and not (tmp_path / "mine.replaced").exists()


def test_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        open_output_dir(tmp_path / "f", "bench")


def test_an_unwritable_destination_fails_at_once(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="cannot be written .*Not a directory"):
        open_output_dir(tmp_path / "f" / "out", "train")


def test_own_output_is_replaced_unless_it_also_holds_the_users_files(tmp_path):
    earlier = user_folder(tmp_path / "run")
    own = {"is_own_output": lambda path: (path / "README.md").is_file(), "own_entries": ("*.md", "*.json")}
    output = open_output_dir(earlier, "bench", **own)
    (output.staging / "results.json").write_text("{}")
    output.commit()
    assert snapshot(earlier) == {"results.json": b"{}"}

    (earlier / "README.md").write_text("mine")
    (earlier / "notes.txt").write_text("mine too")
    before = snapshot(earlier)
    with pytest.raises(
        ValueError,
        match=r"holds an earlier `specdec bench` run, and also notes.txt, which that run "
        r"did not write .*move them away, or pass --force",
    ):
        open_output_dir(earlier, "bench", **own)
    assert snapshot(earlier) == before and not staging_path(earlier).exists()


@pytest.mark.parametrize("place", ["cwd", "parent of cwd", "home"])
def test_the_current_and_home_directories_are_never_replaced(place, tmp_path, monkeypatch):
    for name in ("work", "home"):
        (tmp_path / "top" / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "top" / "work")
    monkeypatch.setenv("HOME", str(tmp_path / "top" / "home"))
    out = {"cwd": ".", "parent of cwd": "..", "home": "~"}[place]
    name = "your home directory" if place == "home" else "the current directory"
    with pytest.raises(ValueError, match=f"{'holds' if place == 'parent of cwd' else 'is'} {name}"):
        open_output_dir(out, "train", force=True)
    assert (
        sorted(p.name for p in (tmp_path / "top").iterdir()) == ["home", "work"] and len(list(tmp_path.iterdir())) == 1
    )


@pytest.mark.parametrize("name", ["run.incomplete", "run.replaced"])
def test_specdecs_working_directories_are_not_an_out(name, tmp_path):
    """Not even with --force: another run may be writing there (found probing: bench --force
    into a training run's staging directory mixed the two)."""
    with pytest.raises(ValueError, match="names ending in .incomplete or .replaced are specdec's working directories"):
        open_output_dir(tmp_path / name, "bench", force=True)
    assert list(tmp_path.iterdir()) == []


def test_a_users_folder_named_like_the_replacement_directory_is_kept(tmp_path):
    out = open_output_dir(tmp_path / "run", "train")
    out.commit()
    user_folder(tmp_path / "run.replaced")
    before = snapshot(tmp_path / "run.replaced")
    with pytest.raises(ValueError, match="run.replaced exists .*move or remove it"):
        open_output_dir(tmp_path / "run", "train", is_own_output=lambda path: True)
    assert snapshot(tmp_path / "run.replaced") == before


def test_an_input_inside_the_staging_directory_is_refused(tmp_path):
    corpus = user_folder(tmp_path / "run.incomplete")
    with pytest.raises(ValueError, match="--out '.*run''s staging directory .* is --corpus"):
        open_output_dir(tmp_path / "run", "train", {"--corpus": corpus}, force=True)


def test_system_places_and_repositories_are_never_replaced(tmp_path):
    etc = Path("/etc")  # a non-empty directory right under / that holds neither cwd nor home
    with pytest.raises(ValueError, match="is /etc, a system directory an output would replace"):
        open_output_dir(etc, "bench", force=True)
    assert not Path("/etc.incomplete").exists()
    repository = user_folder(tmp_path / "repo")
    (repository / ".git").mkdir()
    with pytest.raises(ValueError, match=r"is a repository \(it holds .git\); --force never replaces one"):
        open_output_dir(repository, "bench", force=True)


def own_store(path: Path) -> Path:
    """A directory a command writes into in place (a features store): its manifest and a split."""
    (path / "train").mkdir(parents=True)
    (path / "store.json").write_text("{}\n")
    (path / "train" / "rows.bin").write_bytes(b"\0" * 8)
    return path


IN_PLACE = {"is_own_output": lambda path: (path / "store.json").is_file(), "own_entries": ("store.json", "train/*")}


def test_a_directory_written_in_place_takes_the_rules_of_an_output(tmp_path, monkeypatch):
    """check_written_in_place (train-heads' --features): never an input or a system place, even
    with force; a user's folder only with force (nothing replaced: the files stay), never a
    repository; its own store as it is; nothing made while checking."""
    data = user_folder(tmp_path / "data")
    inputs = {"--data": data}
    refused = [
        ("", False, "--features is empty"),
        (data, True, "--features '.*data' is --data"),
        (data / "sub", True, "lies inside --data"),
        (tmp_path, True, "holds --data"),
        (data / "README.md", True, "is a file"),
        (
            user_folder(tmp_path / "mine"),
            False,
            r"already holds files \(README.md, config.json, tokenizer.json\).*"
            "--force to write this run's files beside them",
        ),
    ]
    for given, force, message in refused:
        with pytest.raises(ValueError, match=message):
            check_written_in_place(given, "--features", "train-heads", inputs, force, **IN_PLACE)
    assert check_written_in_place(tmp_path / "mine", "--features", "x", inputs, True, **IN_PLACE) == tmp_path / "mine"
    assert snapshot(tmp_path / "mine")["README.md"] == b"my notes\n"
    (user_folder(tmp_path / "repo") / ".git").mkdir()
    with pytest.raises(ValueError, match=r"is a repository \(it holds .git\); --force never writes into one"):
        check_written_in_place(tmp_path / "repo", "--features", "x", inputs, True, **IN_PLACE)
    store = own_store(tmp_path / "store")
    assert check_written_in_place(store, "--features", "x", inputs, **IN_PLACE) == store
    (store / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="and also notes.txt, which that run did not write; move them away"):
        check_written_in_place(store, "--features", "x", inputs, **IN_PLACE)
    monkeypatch.chdir(tmp_path / "store")
    with pytest.raises(ValueError, match="--features '.' is the current directory"):
        check_written_in_place(".", "--features", "x", {}, True, **IN_PLACE)
    assert not (tmp_path / "new").exists() and check_written_in_place(tmp_path / "new", "--f", "x", {}) == (
        tmp_path / "new"
    )
    assert not (tmp_path / "new").exists()


def test_a_mount_point_is_refused_up_front(tmp_path, monkeypatch):
    """A mount point (a container's output volume, say) cannot be renamed when the run
    finishes: refused before the run, with where to write instead."""
    mounted = tmp_path / "volume"
    mounted.mkdir()
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == mounted)
    with pytest.raises(ValueError, match=f"is a mount point, .*give a directory inside it, e.g. {mounted / 'out'}"):
        open_output_dir(mounted, "train")
    with open_output_dir(mounted / "out", "train") as output:
        assert output.commit() == mounted / "out"


def test_a_commit_that_cannot_rename_says_where_the_output_is(tmp_path, monkeypatch):
    output = open_output_dir(tmp_path / "run", "bench")
    (output.staging / "results.json").write_text("{}")

    def refuse(source, destination):
        raise OSError(16, "Device or resource busy", str(source))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(ValueError, match=f"could not be moved into place .*it is complete in {output.staging}"):
        output.commit()
    assert (output.staging / "results.json").read_text() == "{}"


def test_a_name_too_long_to_stage_is_refused_up_front(tmp_path):
    with pytest.raises(ValueError, match="its name is too long to stage beside it .* at most 244 bytes"):
        open_output_dir(tmp_path / ("a" * 250), "train")


def test_a_commit_cut_short_after_its_rename_is_finished_by_the_next_run(tmp_path):
    """Killed between moving the staging directory into place and removing its marker: the
    output is whole; the loader says to rerun, and the rerun finishes the commit."""
    output = open_output_dir(tmp_path / "run", "train")
    (output.staging / "model.safetensors").write_bytes(b"weights")
    os.replace(output.staging, output.final)  # the commit, cut short here
    output.lock.close()
    with pytest.raises(ModelLoadError, match="unfinished output of a `specdec train` run"):
        load_pretrained(output.final)
    with pytest.raises(ValueError, match="output of a `specdec train` run whose last step was cut short"):
        open_output_dir(tmp_path / "run", "bench")
    with open_output_dir(
        tmp_path / "run", "train", is_own_output=lambda path: True, own_entries=("model.safetensors",)
    ):
        assert snapshot(tmp_path / "run") == {"model.safetensors": b"weights"}


def test_a_command_that_cannot_resume_leaves_nothing_when_interrupted(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with open_output_dir(tmp_path / "results", "bench", resumable=False) as output:
            (output.staging / "results.json").write_text("{}")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_a_directory_another_run_is_writing_is_refused(tmp_path):
    first = open_output_dir(tmp_path / "out", "train")
    with pytest.raises(ValueError, match="another specdec run is writing --out"):
        open_output_dir(tmp_path / "out", "train")
    first.lock.close()  # the first run ends (a process that dies releases it too)
    with open_output_dir(tmp_path / "out", "train") as second:
        assert second.staging == first.staging


def test_a_failed_run_leaves_nothing_unless_it_wrote_something(tmp_path):
    with pytest.raises(RuntimeError):
        with open_output_dir(tmp_path / "out", "train"):
            raise RuntimeError("failed before writing")
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(KeyboardInterrupt):  # empty directories alone are nothing to resume from
        with open_output_dir(tmp_path / "out", "train") as output:
            (output.staging / "checkpoint").mkdir()
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []

    with pytest.raises(KeyboardInterrupt):
        with open_output_dir(tmp_path / "out", "train") as output:
            (output.staging / "checkpoint").mkdir()
            (output.staging / "checkpoint" / "last.pt").write_bytes(b"a checkpoint")
            raise KeyboardInterrupt
    assert (tmp_path / "out.incomplete" / "checkpoint" / "last.pt").is_file() and not (tmp_path / "out").exists()


def test_staging_directories_not_of_this_command_are_left_alone(tmp_path):
    (tmp_path / "out.incomplete").mkdir()
    (tmp_path / "out.incomplete" / "keep").write_text("x")
    with pytest.raises(ValueError, match="was not made by specdec"):
        open_output_dir(tmp_path / "out", "train")
    shutil.rmtree(tmp_path / "out.incomplete")

    open_output_dir(tmp_path / "out", "train")
    with pytest.raises(ValueError, match="holds an unfinished `specdec train` run"):
        open_output_dir(tmp_path / "out", "distill")


def test_an_unfinished_output_does_not_load(tmp_path):
    staging = open_output_dir(tmp_path / "model", "train").staging
    save_pretrained(new_model(model_shape("tiny").model_config(), seed=0), staging)
    with pytest.raises(ModelLoadError, match="unfinished output of a `specdec train` run"):
        load_pretrained(staging)


def test_saved_weights_get_normal_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        save_pretrained(new_model(model_shape("tiny").model_config(), seed=0), tmp_path, max_shard_bytes=100_000)
    finally:
        os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()}
    assert len(modes) > 3 and set(modes.values()) == {0o644}, modes


# ---------------------------------------------------------------------------- the commands


def test_distill_into_its_own_target_is_refused_and_the_target_kept(model_dir, corpus_dir, capsys):
    before = snapshot(model_dir)
    assert (
        main(
            [
                "distill",
                "--target",
                str(model_dir),
                "--out",
                str(model_dir),
                "--corpus",
                str(corpus_dir),
                *TINY_RUN,
                "--steps",
                "2",
            ]
        )
        == 2
    )
    assert f"is --target '{model_dir}'" in capsys.readouterr().err
    assert snapshot(model_dir) == before
    load_pretrained(model_dir)


def test_train_over_a_model_or_a_users_folder_is_refused(model_dir, corpus_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy, ignore=shutil.ignore_patterns("checkpoint"))  # a model, as shipped
    folder = user_folder(tmp_path / "mine")
    for out in (copy, folder):
        before = snapshot(out)
        assert main(["train", "--corpus", str(corpus_dir), "--out", str(out), *TINY_RUN, "--steps", "2"]) == 2
        assert "not an earlier `specdec train` run's" in capsys.readouterr().err
        assert snapshot(out) == before and not staging_path(out).exists()
    # asked to, it replaces the folder, once the new model is complete
    assert main(["train", "--corpus", str(corpus_dir), "--out", str(folder), *TINY_RUN, "--steps", "2", "--force"]) == 0
    assert not (folder / "README.md").read_text().startswith("my notes") and load_pretrained(folder)


def test_train_with_an_empty_out_writes_nothing(corpus_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("mine")
    assert main(["train", "--corpus", str(corpus_dir), "--out", "", *TINY_RUN, "--steps", "2"]) == 2
    assert "--out is empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["README.md"] and (tmp_path / "README.md").read_text() == "mine"


def test_train_continuing_a_model_into_itself_is_refused(model_dir, corpus_dir, capsys):
    before = snapshot(model_dir)
    assert (
        main(
            [
                "train",
                "--init",
                str(model_dir),
                "--out",
                str(model_dir),
                "--corpus",
                str(corpus_dir),
                "--steps",
                "2",
                "--force",
            ]
        )
        == 2
    )
    assert f"is --init '{model_dir}'" in capsys.readouterr().err
    assert snapshot(model_dir) == before


def test_rerunning_a_finished_run_lengthens_it_in_place(corpus_dir, tmp_path):
    """A run's own --out is not 'a directory of other files': the same command with more
    --steps resumes from its checkpoint and replaces the model when it is done."""
    out = tmp_path / "run"
    run = ["train", "--corpus", str(corpus_dir), "--out", str(out), *TINY_RUN, "--checkpoint-every", "0"]
    assert main([*run, "--steps", "2"]) == 0
    assert main([*run, "--steps", "4"]) == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["step"] == 4 and [e["step"] for e in log["evaluations"]] == [0, 2, 4]
    assert not staging_path(out).exists()


def test_a_finished_run_with_the_users_files_added_is_not_replaced(corpus_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run = ["train", "--corpus", str(corpus_dir), "--out", str(out), *TINY_RUN]
    assert main([*run, "--steps", "2"]) == 0
    (out / "notes.txt").write_text("mine")
    before = snapshot(out)
    for again in (["--steps", "4"], ["--steps", "2", "--restart"]):
        assert main([*run, *again]) == 2
        assert "and also notes.txt, which that run did not write" in capsys.readouterr().err
        assert snapshot(out) == before


def test_the_users_files_inside_a_finished_runs_checkpoint_directory_are_kept(corpus_dir, tmp_path, capsys):
    out = tmp_path / "run"
    run = ["train", "--corpus", str(corpus_dir), "--out", str(out), *TINY_RUN]
    assert main([*run, "--steps", "2"]) == 0
    (out / "checkpoint" / "step1000-keep.pt").write_bytes(b"mine")
    before = snapshot(out)
    assert main([*run, "--steps", "4"]) == 2
    assert "and also checkpoint/step1000-keep.pt, which that run did not write" in capsys.readouterr().err
    assert snapshot(out) == before


def test_a_folder_with_a_foreign_checkpoint_is_not_an_earlier_run(corpus_dir, tmp_path, capsys):
    """A checkpoint/last.pt without the log of a `specdec train` run is not this command's."""
    folder = user_folder(tmp_path / "project")
    (folder / "checkpoint").mkdir()
    torch.save({"weights": torch.ones(2)}, folder / "checkpoint" / "last.pt")
    before = snapshot(folder)
    assert (
        main(["train", "--corpus", str(corpus_dir), "--out", str(folder), *TINY_RUN, "--steps", "2", "--restart"]) == 2
    )
    assert "not an earlier `specdec train` run's" in capsys.readouterr().err
    assert snapshot(folder) == before


def interrupt_at_step(monkeypatch, step: int) -> None:
    """Make the training loop raise KeyboardInterrupt (Ctrl-C) as it starts step `step` + 1."""
    real_step, calls = loop.train_step, []

    def train_step(*args, **kwargs):
        if len(calls) == step:
            raise KeyboardInterrupt
        calls.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", train_step)


def test_an_interrupted_run_leaves_nothing_that_loads_and_resumes(corpus_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    run = [
        "train",
        "--corpus",
        str(corpus_dir),
        "--out",
        str(out),
        *TINY_RUN,
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
    ]
    with monkeypatch.context() as patch:
        interrupt_at_step(patch, 3)
        assert main(run) == 130
    err = capsys.readouterr().err
    staging = staging_path(out)
    assert f"resume from the last checkpoint, {staging / 'checkpoint' / 'last.pt'}" in err
    assert not out.exists()
    for path in (out, staging):
        with pytest.raises(ModelLoadError):
            load_pretrained(path)
    assert main(run) == 0
    assert "resuming from" in capsys.readouterr().err and not staging.exists()
    assert json.loads((out / "training_log.json").read_text())["step"] == 4 and load_pretrained(out)


def test_interrupted_before_the_first_checkpoint_says_so_and_keeps_nothing(corpus_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    interrupt_at_step(monkeypatch, 1)
    assert (
        main(
            [
                "train",
                "--corpus",
                str(corpus_dir),
                "--out",
                str(out),
                *TINY_RUN,
                "--steps",
                "4",
                "--checkpoint-every",
                "2",
            ]
        )
        == 130
    )
    assert "before this run's first checkpoint (--checkpoint-every); nothing was kept" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_bench_refuses_its_inputs_and_a_users_folder_before_measuring(tmp_path, capsys, monkeypatch):
    import specdec.tools.benchmark.run as bench_run

    model = save_tiny_model(tmp_path / "tiny")
    monkeypatch.setattr(bench_run, "run_benchmark", lambda *a, **k: pytest.fail("measured before checking --out"))
    folder = user_folder(tmp_path / "mine")
    results = user_folder(tmp_path / "docs")
    (results / "results.json").write_text('{"prompt_sets": {}}')  # a bench's results, copied among their own
    before = snapshot(tmp_path)
    for out, message in (
        (model, "is --model"),
        (model / "bench", "lies inside --model"),
        (folder, "not an earlier `specdec bench` run's"),
        (results, "and also README.md, config.json, tokenizer.json, which that run did not write"),
    ):
        assert main(["bench", "--model", str(model), "--out", str(out), "--quick", "--no-transformers"]) == 2
        assert message in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_a_model_path_that_is_a_file_says_what_it_is(tmp_path):
    for name, message in (
        ("model.bin", "a .bin checkpoint is a pickle"),
        ("model.gguf", "not a GGUF file"),
        ("model.safetensors", f"point at the directory holding it, '{tmp_path}'"),
        ("notes.txt", "point at a Hugging Face model directory"),
    ):
        (tmp_path / name).write_bytes(b"\0" * 16)
        with pytest.raises(ModelLoadError, match=message):
            load_pretrained(tmp_path / name)


def test_checkpoint_files_stay_loadable_with_torch_weights_only(corpus_dir, tmp_path):
    """The staged checkpoint is a plain tensors-and-data file (no pickled objects)."""
    out = tmp_path / "run"
    assert (
        main(["train", "--corpus", str(corpus_dir), "--out", str(out), *TINY_RUN, "--steps", "2", "--stop-after", "1"])
        == 0
    )
    checkpoint = torch.load(staging_path(out) / "checkpoint" / "last.pt", weights_only=True)
    assert checkpoint["state"]["step"] == 1
    assert (staging_path(out) / STAGING_MARKER).is_file()
