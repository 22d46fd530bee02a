"""`gradientmail export --hf DIR`: a GPT-2 run as a directory `from_pretrained` loads.

A tiny GPT-2 (the recipes' `GPT2Module`, whose parameters carry the `model.` prefix) is
trained by one learner for a few rounds; the exported directory is loaded with
`transformers.AutoModelForCausalLM.from_pretrained` offline and its logits compared with
the committed model's. The configuration's sources (the shapes, a recipe, a config.json,
`--n-head`) and their disagreements are tested on shapes alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_learner_runtime import FAST

from gradientmail.adapters import TorchAdapter
from gradientmail.algorithms.diloco import DiLoCo
from gradientmail.app.cli import main
from gradientmail.app.export import gpt2_config, gpt2_shapes, hf_tensors, read_config_file
from gradientmail.errors import ConfigError
from gradientmail.learner.options import LearnerOptions
from gradientmail.learner.runtime import Learner
from gradientmail.run.committed import load_committed, read_committed
from gradientmail.wire.tensor_bytes import TensorBytes

REPO = Path(__file__).resolve().parent.parent
SIZES = {"vocab_size": 64, "block_size": 8, "n_layer": 2, "n_embd": 16, "n_head": 2}
RECIPE = """\
model:
  n_layer: 2
  n_embd: 16
  n_head: 2
  dropout: 0.0
  eos_token_id: 5
data:
  vocab_size: 64
  block_size: 8
"""


def gpt2_module() -> Any:
    from gradientmail_lightning.gpt2 import GPT2Module

    return GPT2Module(**SIZES, eos_token_id=5, seed=0)


def shapes_of(n_layer: int = 2, n_embd: int = 16, vocab: int = 64, positions: int = 8,
              inner: int | None = None, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    inner = 4 * n_embd if inner is None else inner
    out = {f"{prefix}transformer.wte.weight": (vocab, n_embd),
           f"{prefix}transformer.wpe.weight": (positions, n_embd)}
    for i in range(n_layer):
        out[f"{prefix}transformer.h.{i}.mlp.c_fc.weight"] = (n_embd, inner)
        out[f"{prefix}transformer.h.{i}.ln_1.weight"] = (n_embd,)
    out[f"{prefix}transformer.ln_f.weight"] = (n_embd,)
    return out


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of one learner training the tiny GPT2Module for 12 steps, a round every 2,
    waiting at each for its commit (so all six rounds are committed, however loaded the
    machine)."""
    url = tmp_path_factory.mktemp("hf") / "run"
    module = gpt2_module()
    diloco = DiLoCo(sync_every=2, fragments=1, in_flight=1, overlap_steps=0)
    learner = Learner(TorchAdapter(module), diloco, str(url), "learner-0",
                      options=LearnerOptions(**FAST))
    learner.start()
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        ids = torch.randint(0, 64, (4, 8), generator=g)
        opt.zero_grad()
        module(ids).backward()
        opt.step()
        learner.step(32)
    learner.close()
    return url


def test_the_exported_directory_loads_with_from_pretrained_and_gives_the_same_logits(
        gpt2_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    out = tmp_path / "hf" / "tiny"
    assert main(["export", str(gpt2_run), "--hf", str(out), "--config", str(recipe)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {out}: config.json (GPT-2, 2 layers, 16 wide, 2 heads, "
                              "vocabulary 64) and model.safetensors (")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    committed = read_committed(str(gpt2_run))
    assert committed.round == 5  # the model trained: six rounds, not Θ⁰
    reference = gpt2_module()
    load_committed(str(gpt2_run), reference)
    hf = AutoModelForCausalLM.from_pretrained(str(out))
    assert isinstance(hf, GPT2LMHeadModel)
    config = hf.config
    assert (config.n_head, config.n_layer, config.n_embd, config.vocab_size,
            config.n_positions, config.eos_token_id) == (2, 2, 16, 64, 8, 5)
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied
    for name, p in reference.model.named_parameters():
        assert torch.equal(hf.get_parameter(name), p), name
    reference.eval()
    hf.eval()
    ids = torch.randint(0, 64, (3, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference.model(input_ids=ids).logits
        got = hf(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-5)
    # --n-head alone gives the same model (GPT2Module's eos default, 0, aside).
    again = tmp_path / "by-heads"
    assert main(["export", str(gpt2_run), "--hf", str(again), "--n-head", "2"]) == 0
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert json.loads((again / "config.json").read_text())["n_head"] == 2


def test_without_the_heads_the_export_says_how_to_give_them(
        gpt2_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    assert main(["export", str(gpt2_run), "--hf", str(out)]) == 1
    assert capsys.readouterr().err == (
        "gradientmail: error: the number of attention heads shows in no parameter's shape: "
        "pass --n-head N, or --config with the recipe YAML the run trained with (or a "
        "config.json)\n")
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(RECIPE.replace("n_embd: 16", "n_embd: 32"))
    assert main(["export", str(gpt2_run), "--hf", str(out), "--config", str(wrong)]) == 1
    assert capsys.readouterr().err == (
        f"gradientmail: error: --config {str(wrong)!r} says n_embd=32, but the run's "
        "parameters give n_embd=16: pass the config the run trained with\n")
    assert main(["export", str(gpt2_run)]) == 1
    assert "got neither: give one of them" in capsys.readouterr().err
    assert main(["export", str(gpt2_run), str(tmp_path / "m.safetensors"), "--hf",
                 str(out)]) == 1
    assert "got both: give one of them" in capsys.readouterr().err
    assert main(["export", str(gpt2_run), str(tmp_path / "m.safetensors"), "--n-head",
                 "2"]) == 1
    assert "--config and --n-head describe the model of --hf DIR" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "m.safetensors").exists()


# -- the configuration (pure) -------------------------------------------------------------


def test_the_shapes_give_every_size_but_the_heads() -> None:
    assert gpt2_shapes(shapes_of()) == ("model.", {
        "vocab_size": 64, "n_positions": 8, "n_embd": 16, "n_layer": 2, "n_inner": None})
    prefix, sizes = gpt2_shapes(shapes_of(n_layer=3, inner=24, prefix=""))
    assert prefix == "" and sizes["n_layer"] == 3 and sizes["n_inner"] == 24
    with pytest.raises(ConfigError, match=r"hold no GPT-2 token embedding .* export a "
                       "safetensors file instead"):
        gpt2_shapes({"0.weight": (2, 6)})
    with pytest.raises(ConfigError, match=r"parameters \['head.weight'\] are not GPT-2's"):
        gpt2_shapes({**shapes_of(), "head.weight": (2, 16)})


def test_the_recipes_give_their_models_config() -> None:
    recipe = read_config_file(str(REPO / "recipes" / "gpt2-124m.yaml"))
    config = gpt2_config(shapes_of(12, 768, 50304, 1024), source=recipe)
    assert {k: config[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head",
                                   "n_inner", "eos_token_id", "bos_token_id",
                                   "tie_word_embeddings", "model_type")} == {
        "vocab_size": 50304, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "n_inner": None, "eos_token_id": 50256, "bos_token_id": 50256,
        "tie_word_embeddings": True, "model_type": "gpt2"}
    tiny = read_config_file(str(REPO / "recipes" / "gpt2-tiny-cpu.yaml"))
    assert gpt2_config(shapes_of(2, 128, 4096, 128), source=tiny)["n_head"] == 4
    with pytest.raises(ConfigError, match=r"says vocab_size=4096, but the run's parameters "
                       "give vocab_size=64"):
        gpt2_config(shapes_of(2, 128, 64, 128), source=tiny)
    with pytest.raises(ConfigError, match=r"--n-head 8 disagrees with --config's n_head=4"):
        gpt2_config(shapes_of(2, 128, 4096, 128), source=tiny, n_head=8)
    with pytest.raises(ConfigError, match=r"n_head=3 does not divide n_embd=16"):
        gpt2_config(shapes_of(), n_head=3)


def test_a_config_json_is_taken_whole_and_checked(tmp_path: Path) -> None:
    from transformers import GPT2Config

    path = tmp_path / "config.json"
    path.write_text(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=4,
                               layer_norm_epsilon=1e-6).to_json_string())
    config = gpt2_config(shapes_of(), source=read_config_file(str(path)))
    assert (config["n_head"], config["layer_norm_epsilon"]) == (4, 1e-6)
    path.write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="model_type 'llama', not 'gpt2'"):
        gpt2_config(shapes_of(), source=read_config_file(str(path)))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        read_config_file(str(path))


def test_a_separate_output_layer_is_kept_and_untied() -> None:
    def t(value: float) -> TensorBytes:
        return TensorBytes.from_numpy(torch.full((4, 2), value).numpy())

    tied, is_tied = hf_tensors({"model.transformer.wte.weight": t(1.0),
                                "model.lm_head.weight": t(1.0)}, "model.")
    assert list(tied) == ["transformer.wte.weight"] and is_tied
    own, is_tied = hf_tensors({"transformer.wte.weight": t(1.0), "lm_head.weight": t(2.0)}, "")
    assert sorted(own) == ["lm_head.weight", "transformer.wte.weight"] and not is_tied
