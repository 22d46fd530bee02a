"""`gradientmail export`: the newest committed model as one safetensors file
(`write_safetensors`), or a run of a GPT-2 model as a Hugging Face model directory:

    gradientmail export URL OUT.safetensors
    gradientmail export URL --hf DIR --config recipes/gpt2-124m.yaml
    gradientmail export URL --hf DIR --n-head 12

DIR gets `config.json` and `model.safetensors`, which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads as a `GPT2LMHeadModel`.

A run's manifest knows each parameter's name and shape, not the model's configuration.
The shapes give `vocab_size` (the token embedding's rows), `n_positions` (the position
embedding's), `n_embd`, `n_layer` (the blocks `h.<i>`) and `n_inner` (the MLP's width);
the number of attention heads shows in no shape, so it comes from `--config` (the recipe
YAML the run trained with: its `model.n_head`, with `model.eos_token_id` and
`model.dropout`; or a GPT-2 `config.json`) or from `--n-head`. Every size the file states
is checked against the shapes. Parameter names lose the prefix of the module that held
the network (`model.` for the recipes' `GPT2Module`; none for a bare `GPT2LMHeadModel`);
the output layer is tied to the token embedding, as GPT-2's is, unless the run holds an
`lm_head.weight` of its own that differs from it.

`gpt2_shapes` and `gpt2_config` are pure; `hf_tensors` renames; `write_hf` writes.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

from gradientmail.errors import ConfigError, MissingExtra
from gradientmail.wire.serialization import pack
from gradientmail.wire.tensor_bytes import TensorBytes

__all__ = [
    "EMBEDDING",
    "gpt2_config",
    "gpt2_shapes",
    "hf_tensors",
    "read_config_file",
    "write_hf",
    "write_safetensors",
]

#: The parameter whose name locates the network in a run: `<prefix>transformer.wte.weight`.
EMBEDDING = "transformer.wte.weight"
_BLOCK = re.compile(r"^transformer\.h\.(\d+)\.")
# GPT2LMHeadModel's defaults that GPT2Module (gradientmail.integration.textdata.tiny_gpt2) keeps.
_ACTIVATION = "gelu_new"
_LAYER_NORM_EPSILON = 1e-5
_INITIALIZER_RANGE = 0.02
_RECIPE_DEFAULTS = {"n_head": 12, "eos_token_id": 0, "dropout": 0.0}  # GPT2Module's


def gpt2_shapes(shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, dict[str, int | None]]:
    """The prefix of the GPT-2 network among a run's parameters (name -> shape) and the
    sizes its shapes show: vocab_size, n_positions, n_embd, n_layer, and n_inner (None
    when it is GPT-2's 4 * n_embd). `ConfigError` for a run that is no GPT-2."""
    found = [n for n in shapes if n.endswith(EMBEDDING)]
    if len(found) != 1:
        raise ConfigError(
            f"the run's parameters hold {len(found) or 'no'} GPT-2 token embedding"
            f"{'s' if len(found) > 1 else ''} (a name ending in {EMBEDDING!r}); --hf writes "
            "the GPT-2 models of the recipes: export a safetensors file instead"
        )
    prefix = found[0][: -len(EMBEDDING)]
    names = {n[len(prefix):]: s for n, s in shapes.items() if n.startswith(prefix)}
    others = sorted(n for n in shapes if not n.startswith(prefix)
                    or not n[len(prefix):].startswith(("transformer.", "lm_head.")))
    if others:
        raise ConfigError(
            f"the run's parameters {others[:3]} are not GPT-2's (under {prefix!r}: "
            "transformer.* and lm_head.*); --hf writes a GPT2LMHeadModel alone"
        )
    vocab, width = _shape(names, EMBEDDING, 2)
    positions, _ = _shape(names, "transformer.wpe.weight", 2)
    layers = sorted({int(m.group(1)) for n in names if (m := _BLOCK.match(n))})
    if layers != list(range(len(layers))) or not layers:
        raise ConfigError(f"the run's GPT-2 blocks are {layers}; need h.0 .. h.<n_layer-1>")
    _, inner = _shape(names, "transformer.h.0.mlp.c_fc.weight", 2)
    return prefix, {"vocab_size": vocab, "n_positions": positions, "n_embd": width,
                    "n_layer": len(layers), "n_inner": None if inner == 4 * width else inner}


def _shape(names: Mapping[str, tuple[int, ...]], name: str, dims: int) -> tuple[int, ...]:
    shape = names.get(name)
    if shape is None or len(shape) != dims:
        raise ConfigError(f"the run's GPT-2 parameter {name!r} is "
                          f"{'missing' if shape is None else list(shape)}; need {dims} dims")
    return shape


def read_config_file(path: str) -> dict[str, Any]:
    """The mapping in `path`: a recipe YAML (`.yaml`/`.yml`) or a config.json."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read --config {path!r}: {exc.strerror or exc}") from exc
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as exc:
            raise MissingExtra("lightning", "reading a recipe YAML") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path!r} is not valid YAML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"--config {path!r} is not valid JSON ({exc}); a recipe "
                              "ends in .yaml or .yml") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path!r} holds a {type(data).__name__}, not a mapping")
    return data


def gpt2_config(shapes: Mapping[str, tuple[int, ...]], *, n_head: int | None = None,
                source: Mapping[str, Any] | None = None,
                source_name: str = "--config") -> dict[str, Any]:
    """The config.json of the GPT-2 the run trained: its sizes from `shapes`, the number
    of heads from `n_head` or `source`, and the rest from `source` (a recipe: its `model`
    and `data` sections; or a GPT-2 config.json) or GPT2Module's defaults. `ConfigError`
    naming the value when `source` or `n_head` disagrees with the shapes or each other."""
    _, sizes = gpt2_shapes(shapes)
    stated: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if source is not None and source.get("model_type") is not None:
        if source["model_type"] != "gpt2":
            raise ConfigError(f"{source_name} is a config of model_type "
                              f"{source['model_type']!r}, not 'gpt2'")
        extra = {k: v for k, v in source.items() if not k.startswith("_")}
        stated = {k: source[k] for k in (*sizes, "n_head") if k in source}
    elif source is not None:
        model, data = _section(source, "model", source_name), _section(source, "data",
                                                                       source_name)
        for ours, key, where in (("vocab_size", "vocab_size", (data, model)),
                                 ("n_positions", "block_size", (data, model)),
                                 ("n_embd", "n_embd", (model,)), ("n_layer", "n_layer", (model,)),
                                 ("n_head", "n_head", (model,))):
            for section in where:
                if section.get(key) is not None:
                    stated[ours] = section[key]
                    break
        stated.setdefault("n_head", _RECIPE_DEFAULTS["n_head"])
        eos = model.get("eos_token_id", _RECIPE_DEFAULTS["eos_token_id"])
        dropout = model.get("dropout", _RECIPE_DEFAULTS["dropout"])
        extra = {"bos_token_id": eos, "eos_token_id": eos, "resid_pdrop": dropout,
                 "embd_pdrop": dropout, "attn_pdrop": dropout}
    for key, value in stated.items():
        if key in sizes and value != sizes[key]:
            raise ConfigError(f"{source_name} says {key}={value!r}, but the run's parameters "
                              f"give {key}={sizes[key]!r}: pass the config the run trained "
                              "with")
    heads = stated.get("n_head")
    if n_head is not None and heads is not None and n_head != heads:
        raise ConfigError(f"--n-head {n_head} disagrees with {source_name}'s n_head={heads}; "
                          "give one of them")
    heads = n_head if n_head is not None else heads
    if heads is None:
        raise ConfigError(
            "the number of attention heads shows in no parameter's shape: pass --n-head N, "
            "or --config with the recipe YAML the run trained with (or a config.json)"
        )
    width = sizes["n_embd"]
    assert width is not None
    if not isinstance(heads, int) or heads < 1 or width % heads:
        raise ConfigError(f"n_head={heads!r} does not divide n_embd={width}")
    eos = extra.get("eos_token_id", _RECIPE_DEFAULTS["eos_token_id"])
    dropout = _RECIPE_DEFAULTS["dropout"]
    return {
        "activation_function": _ACTIVATION,
        "layer_norm_epsilon": _LAYER_NORM_EPSILON,
        "initializer_range": _INITIALIZER_RANGE,
        "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
        "bos_token_id": eos, "eos_token_id": eos,
        "tie_word_embeddings": True,
        **extra,
        **sizes,
        "n_head": heads,
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
    }


def _section(source: Mapping[str, Any], name: str, source_name: str) -> Mapping[str, Any]:
    section = source.get(name) or {}
    if not isinstance(section, dict):
        raise ConfigError(f"{source_name}'s {name!r} is a {type(section).__name__}, not a "
                          "mapping")
    # A LightningCLI config may spell a section as class_path + init_args.
    args = section.get("init_args")
    return args if isinstance(args, dict) else section


def hf_tensors(tensors: Mapping[str, TensorBytes],
               prefix: str) -> tuple[dict[str, TensorBytes], bool]:
    """The run's parameters under GPT2LMHeadModel's names (`prefix` removed), and whether
    the output layer is tied to the token embedding: True when the run holds no
    `lm_head.weight` (a tied model's parameters list the shared tensor once) or holds
    one equal to the embedding (then left out, as `save_pretrained` leaves it out)."""
    out = {n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)}
    head = out.get("lm_head.weight")
    if head is None:
        return out, True
    wte = out[EMBEDDING]
    if (head.dtype, head.shape) == (wte.dtype, wte.shape) and bytes(head.buffer) == bytes(
            wte.buffer):
        del out["lm_head.weight"]
        return out, True
    return out, False


def write_hf(directory: str, tensors: Mapping[str, TensorBytes], config: Mapping[str, Any],
             metadata: Mapping[str, str]) -> tuple[int, int]:
    """Write `config.json` and `model.safetensors` into `directory` (created, with its
    parents, when missing), each atomically; returns the two files' sizes."""

    try:
        os.makedirs(directory, exist_ok=True)
        text = (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode()
        fd, tmp = tempfile.mkstemp(prefix=".gradientmail-export-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text)
            os.replace(tmp, os.path.join(directory, "config.json"))
        except BaseException:
            os.unlink(tmp)
            raise
        size = write_safetensors(os.path.join(directory, "model.safetensors"), dict(tensors),
                                 dict(metadata))
    except OSError as exc:
        raise ConfigError(f"cannot write {directory!r}: {exc.strerror or exc}") from exc
    return len(text), size


def write_safetensors(path: str, tensors: dict[str, TensorBytes],
                      metadata: dict[str, str]) -> int:
    """Write `tensors` as a safetensors file at `path` atomically; returns its size."""
    blob = pack(tensors, metadata)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".gradientmail-export-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return len(blob)
