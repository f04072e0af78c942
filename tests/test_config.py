"""Config loading: overrides, unknown sections, and the resolved config written into the run folder."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from diffpipe.config import ConfigError, save_config
from diffpipe.config_files import build_config, load_config
from diffpipe.models.families.unet.presets import UNET_PRESETS


def test_resolved_config_round_trips(tmp_path):
    config = build_config({"train": {"max_steps": 7}}, ["pipeline.split=[4]", "train.precision=bf16"])
    save_config(config, tmp_path / "config.toml")
    again = load_config(tmp_path / "config.toml")
    assert again == config
    assert again.pipeline.split == [4] and again.train.precision == "bf16"


def test_unknown_section_lists_the_sections():
    with pytest.raises(ConfigError, match="trian: unknown key; did you mean 'train'?"):
        build_config({"trian": {"max_steps": 3}})


def test_override_without_value_explains_the_form():
    with pytest.raises(ConfigError, match="expected section.key=value"):
        build_config({}, ["train.max_steps"])


def test_invalid_toml_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nmax_steps = 3")
    with pytest.raises(ConfigError, match="bad.toml is not valid TOML"):
        load_config(bad)


def test_interleaved_needs_virtual_stages():
    with pytest.raises(ConfigError, match="needs pipeline.virtual_stages >= 2"):
        build_config({"pipeline": {"schedule": "interleaved_1f1b"}})


def test_the_model_is_described_by_what_is_used(tmp_path):
    """The start-up line names the model's source: an inline config or a folder, not the preset left at its default."""
    assert build_config({}).model.describe() == "unet2d (preset digits)"
    assert build_config({"model": {"config": {"sample_size": 8}}}).model.describe() == "unet2d (model.config)"
    assert build_config({"model": {"path": str(tmp_path)}}).model.describe() == f"unet2d ({tmp_path})"
    single = build_config({"model": {"preset": "sdxl", "path": str(tmp_path / "x.safetensors")}})
    assert single.model.describe() == f"unet2d (preset sdxl, weights {tmp_path / 'x.safetensors'})"


def test_latent_sizes_the_unet_does_not_divide_pass_the_checks_before_launch():
    from diffpipe.preflight import check_before_launch

    config = build_config({"data": {"dataset": "synthetic"}, "model": {"config": dict(UNET_PRESETS["digits"], sample_size=9)},
                           "train": {"batch_size": 8}})
    check_before_launch(config)  # diffusers' UNet handles 9x9 (down to 5x5, up to 9x9): no refusal


def test_docs_config_md_is_the_generated_reference():
    """docs/config.md is `diffpipe config --markdown`: regenerate it after changing the schema."""
    from pathlib import Path

    from diffpipe.config_reference import config_reference

    docs = Path(__file__).parent.parent / "docs" / "config.md"
    assert docs.read_text() == config_reference(markdown=True) + "\n", \
        "docs/config.md is stale: run `diffpipe config --markdown > docs/config.md`"
    text = config_reference()
    for section in ("[model]", "[data]", "[train]", "[pipeline]", "[plan]", "[observe]", "[output]", "[sample]"):
        assert section in text
    assert "max_grad_norm = 1.0" in text and "schedule = \"1f1b\"" in text


def test_a_saved_config_names_its_folders_absolutely(tmp_path, monkeypatch):
    """`diffpipe sample RUN` from another directory read model.path and data paths relative to the new one."""
    from diffpipe.config import make_paths_absolute, save_config
    from diffpipe.config_files import build_config, load_config

    monkeypatch.chdir(tmp_path)
    config = make_paths_absolute(build_config({
        "model": {"path": "models/sdxl", "text_encoder": "clip"},
        "data": {"dataset": "folder", "path": ["photos", "more"], "eval_path": "held", "cache_dir": "~/cache"}}))
    save_config(config, tmp_path / "config.toml")
    monkeypatch.chdir("/")
    saved = load_config(tmp_path / "config.toml")
    assert saved.model.path == str(tmp_path / "models" / "sdxl") and saved.model.text_encoder == str(tmp_path / "clip")
    assert saved.data.path == [str(tmp_path / "photos"), str(tmp_path / "more")]
    assert saved.data.eval_path == str(tmp_path / "held") and not saved.data.cache_dir.startswith("~")
    assert make_paths_absolute(build_config({})).model.text_encoder == "tiny-clip"


def test_data_sources_are_asked_not_named():
    """data/sources.py owns what differs between data sources: a name its registry lacks is refused when the config
    is built (with the registry's names and the nearest), and no module outside data/ tests data.dataset's name."""
    from diffpipe.data.sources import SOURCES

    with pytest.raises(ConfigError, match=r"data.dataset: 'digit' is not one of .*; did you mean 'digits'\?") as refused:
        build_config({"data": {"dataset": "digit"}})
    assert all(name in str(refused.value) for name in SOURCES)
    with pytest.raises(ConfigError, match=r"pipeline.schedule: '1f1c' is not one of .*did you mean '1f1b'"):
        build_config({"pipeline": {"schedule": "1f1c"}})
    with pytest.raises(ConfigError, match=r"model.architecture: 'flx' is not one of .*module:Class.*did you mean 'flux'"):
        build_config({"model": {"architecture": "flx"}})
    package = Path(__file__).parent.parent / "diffpipe"
    naming = [f"{path.relative_to(package)}:{n}" for path in package.rglob("*.py") if path.parent.name != "data"
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(r"dataset\s*(==|!=|in\b)", line)]
    assert not naming, naming


@pytest.mark.parametrize("dataset", ["synthetic", "moving_digits"])
def test_an_eval_loss_without_held_out_data_is_refused_before_launch(dataset):
    """Moving digits have no held-out split: an eval loss asked of them failed in every process as it built the run
    (an AttributeError from the data, by reading the code before data/sources.py)."""
    with pytest.raises(ConfigError, match=f"data.dataset = '{dataset}' has none"):
        build_config({"data": {"dataset": dataset}, "train": {"eval_every": 5}})
    build_config({"data": {"dataset": "digits"}, "train": {"eval_every": 5}})


def test_the_architecture_help_names_every_built_in_family():
    """The help (and docs/config.md) named 3 of the 5 families (issue 31); the reference now reads the choices from
    the registry, so every family is named once, there."""
    from diffpipe.config_reference import config_reference
    from diffpipe.models.registry import BUILTIN_FAMILIES

    line = next(line for line in config_reference(markdown=True).splitlines() if line.startswith("| `architecture`"))
    assert [name for name in BUILTIN_FAMILIES if f'"{name}"' not in line] == []


def test_the_reference_writes_bounded_types_in_words_not_pydantics_repr():
    """docs/config.md showed `Annotated[int, annotation=NoneType required=True metadata=[Ge(ge=0)]]` (issue 56)."""
    from diffpipe.config_reference import config_reference

    text = config_reference(markdown=True)
    assert "Annotated" not in text and "FieldInfo" not in text and "NoneType" not in text
    assert '| `block_swap` | int (>= 0) &#124; "auto" |' in text and "list[float (>= 0, < 1)]" in text


def test_export_help_names_every_format_and_what_force_replaces(capsys):
    from diffpipe.cli import main
    from diffpipe.export import FORMATS

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"{name}:" in text for name in FORMATS) and "replace an earlier export" in text
