"""Checkpoints in Kimi-Linear's own format: Moonshot's ``config.json`` fields and tensor names, safetensors.

A model folder holds ``config.json`` (the fields of ``moonshotai/Kimi-Linear-48B-A3B-Instruct``'s config:
``model_type`` "kimi_linear", MLA sizes, MoE sizes, ``linear_attn_config`` with 1-based ``full_attn_layers`` /
``kda_layers``, ``num_heads``, ``head_dim``, ``short_conv_kernel_size``), the weights as ``model.safetensors`` or
as shards listed by ``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file), and, for the
shipped byte models, a ``tokenizer.json``. Tensor names are Moonshot's (``modeling_kimi.py``), which
transformers' ``KimiLinearForCausalLM`` reads through its ``conversion_mapping.py`` and llama.cpp's
``convert_hf_to_gguf.py`` converts:

=========================================================  ============================================
Moonshot name (``model.layers.{i}.`` prefix)               ours (``HybridLM``)
=========================================================  ============================================
``self_attn.{q,k,v}_proj.weight`` (KDA)                    ``mixers[i].qkv_proj`` rows q | k | v
``self_attn.{q,k,v}_conv1d.weight`` ``[HK, 1, W]``         ``mixers[i].conv_weight`` ``[3HK, W]``
``self_attn.A_log`` ``[1, 1, H, 1]``                       ``mixers[i].A_log`` ``[H]``
``self_attn.{f_a,f_b,b,g_a,g_b,o}_proj.weight``, ``dt_bias``  same names without ``_proj`` for f/g
``self_attn.o_norm.weight``                                ``mixers[i].o_norm``
``self_attn.{q_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj}`` (MLA)  ``q_proj``, ``kv_a``, ``kv_b``, ``o_proj``
``self_attn.kv_a_layernorm.weight``                        ``mixers[i].kv_norm``
``mlp.{gate,up,down}_proj.weight`` (dense layers)          ``ffn[i].gate_up`` (gate | up), ``ffn[i].down``
``block_sparse_moe.gate.weight`` / ``.e_score_correction_bias``  ``ffn[i].router`` / ``ffn[i].router_bias``
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight``         ``ffn[i].experts_gate_up[e]`` (w1 | w3), ``experts_down[e]``
``block_sparse_moe.shared_experts.{gate,up,down}_proj``    ``ffn[i].shared``
``input_layernorm`` / ``post_attention_layernorm``         ``norm1[i]`` / ``norm2[i]``
``model.embed_tokens``, ``model.norm``, ``lm_head``        ``embed``, ``norm_f``, ``lm_head``
=========================================================  ============================================

A dense layer's ``mlp.*`` is also read under ``block_sparse_moe.*``, the name transformers' ``save_pretrained``
gives it (:func:`transformers_dense_name`).

:func:`read_config` reads ``config.json``; :func:`load` reads the tensors one at a time (``safetensors.safe_open``)
into fp32, and they raise ValueError naming every missing, unexpected or mis-shaped tensor, and every config field
whose value this engine does not support (``q_lora_rank`` not null, a router other than sigmoid, tied
embeddings, ``moe_layer_freq`` other than 1, ...). :func:`save` writes the same format (sharded above
``max_shard_bytes``).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kda_core.config import ModelConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"
STORE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD_BYTES = 2 * 1024 ** 3
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps",
            "linear_attn_config")
REQUIRED_LINEAR = ("full_attn_layers", "kda_layers", "num_heads", "head_dim", "short_conv_kernel_size")
# config fields whose other values change the maths: field -> (value we run, why)
SUPPORTED = {"q_lora_rank": (None, "a low-rank query (q_a_proj / q_b_proj) is not implemented"),
             "hidden_act": ("silu", "every MLP and expert is SwiGLU"),
             "moe_router_activation_func": ("sigmoid", "the router is DeepSeek-V3's sigmoid router"),
             "tie_word_embeddings": (False, "lm_head is a separate weight"),
             "moe_layer_freq": (1, "every layer after first_k_dense_replace is an MoE layer"),
             "attention_bias": (False, "no projection has a bias"),
             "mla_use_output_gate": (False, "MLA has no output gate (Kimi K3's variant)")}


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` dict of ``cfg`` in Kimi-Linear's format, weights stored in ``dtype``.

    Raises ValueError for a dtype not in :data:`STORE_DTYPES` or ``head_k_dim != head_v_dim`` (the format has one
    ``head_dim``)."""
    names = {v: k for k, v in STORE_DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(STORE_DTYPES)}, got {dtype}")
    if cfg.head_k_dim != cfg.head_v_dim:
        raise ValueError(f"Kimi-Linear's format has one linear_attn_config.head_dim: head_k_dim ({cfg.head_k_dim}) "
                         f"must equal head_v_dim ({cfg.head_v_dim})")
    linear_attn = {"full_attn_layers": [i + 1 for i in cfg.mla_layers], "kda_layers": [i + 1 for i in cfg.kda_layers],
                   "num_heads": cfg.num_heads, "head_dim": cfg.head_k_dim, "short_conv_kernel_size": cfg.conv_kernel}
    if cfg.gate == "lower_bound":
        linear_attn["gate_lower_bound"] = cfg.lower_bound
    dense_all = cfg.num_experts == 0
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "torch_dtype": names[dtype],
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_mla_heads,
        "num_key_value_heads": cfg.num_mla_heads, "q_lora_rank": None, "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim, "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim, "mla_use_nope": cfg.mla_use_nope,
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_shared_experts": cfg.num_shared_experts,
        "routed_scaling_factor": cfg.routed_scaling_factor, "moe_renormalize": cfg.moe_renormalize,
        "moe_router_activation_func": "sigmoid", "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group, "use_grouped_topk": True, "moe_layer_freq": 1,
        "first_k_dense_replace": cfg.num_layers if dense_all else cfg.first_k_dense_replace,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": False,
        "attention_bias": False, "model_max_length": 1048576, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "linear_attn_config": linear_attn,
    }


def _field(d: dict, key: str, prefix: str = ""):
    if key not in d:
        raise ValueError(f"config.json is missing the field {prefix + key!r}")
    return d[key]


def config_from_hf(d: dict, name: str = "", source: str = "") -> ModelConfig:
    """The :class:`ModelConfig` of a Kimi-Linear ``config.json`` dict.

    Raises ValueError naming the field: another ``model_type``, a missing field, a value this engine does not
    run (:data:`SUPPORTED`), layer lists that do not cover every layer once (and whatever ``ModelConfig``
    rejects)."""
    if not isinstance(d, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
    if d.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config.json field 'model_type' must be {MODEL_TYPE!r}, got {d.get('model_type')!r}")
    for key in REQUIRED:
        _field(d, key)
    lin = d["linear_attn_config"]
    if not isinstance(lin, dict):
        raise ValueError("config.json field 'linear_attn_config' must be an object")
    for key in REQUIRED_LINEAR:
        _field(lin, key, "linear_attn_config.")
    for key, (value, why) in SUPPORTED.items():
        if key in d and d[key] != value:
            raise ValueError(f"config.json field {key!r} = {d[key]!r} is not supported ({why}); need {value!r}")
    if lin.get("use_full_rank_gate"):
        raise ValueError("config.json field 'linear_attn_config.use_full_rank_gate' = true is not supported "
                         "(the forget gate is low-rank f_b(f_a(x)))")
    L = d["num_hidden_layers"]
    mla = [i - 1 for i in lin["full_attn_layers"]]
    kda = [i - 1 for i in lin["kda_layers"]]
    if sorted(mla + kda) != list(range(L)):
        raise ValueError(f"config.json fields 'linear_attn_config.full_attn_layers' and '.kda_layers' must name each "
                         f"of the layers 1..{L} once, got {lin['full_attn_layers']} and {lin['kda_layers']}")
    lower = lin.get("gate_lower_bound")
    num_experts = d.get("num_experts", 0) or 0
    first_dense = d.get("first_k_dense_replace", 0) or 0
    if num_experts and first_dense >= L:
        num_experts = 0
    try:
        return ModelConfig(
            name=name or d.get("name", "") or "kimi-linear", num_layers=L, mla_layers=tuple(mla),
            hidden_size=d["hidden_size"], num_heads=lin["num_heads"], head_k_dim=lin["head_dim"],
            head_v_dim=lin["head_dim"], kv_lora_rank=d["kv_lora_rank"], qk_rope_head_dim=d["qk_rope_head_dim"],
            gate="lower_bound" if lower is not None else "softplus",
            lower_bound=float(lower) if lower is not None else None, conv_kernel=lin["short_conv_kernel_size"],
            vocab_size=d["vocab_size"], num_mla_heads=d["num_attention_heads"],
            qk_nope_head_dim=d["qk_nope_head_dim"], v_head_dim=d["v_head_dim"],
            intermediate_size=d["intermediate_size"], rms_norm_eps=float(d["rms_norm_eps"]),
            mla_use_nope=bool(d.get("mla_use_nope", False)), num_experts=num_experts,
            num_experts_per_token=d.get("num_experts_per_token", 1) or 1,
            moe_intermediate_size=d.get("moe_intermediate_size", 1) or 1,
            num_shared_experts=d.get("num_shared_experts", 0) or 0,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            moe_renormalize=bool(d.get("moe_renormalize", True)),
            num_expert_group=d.get("num_expert_group", 1) or 1, topk_group=d.get("topk_group", 1) or 1,
            first_k_dense_replace=first_dense if num_experts else 0, source=source or d.get("source", ""))
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from None


def _layer_names(cfg: ModelConfig, i: int) -> list[tuple[str, str, tuple]]:
    """(Moonshot name, our state-dict name, slice spec) of layer i; the spec says which part of our tensor the
    Moonshot tensor is: ``()`` the whole tensor, ``("index", i)`` row i, ``("rows", a, b)`` rows [a, b),
    ``("conv", a, b)`` rows [a, b) as ``[n, 1, W]``, ``("expert", e, a, b)`` rows
    [a, b) of expert e, ``("view", shape)`` the whole tensor reshaped."""
    p, o = f"model.layers.{i}.", f"mixers.{i}."
    H, K = cfg.num_heads, cfg.head_k_dim
    HK = H * K
    out = [(p + "input_layernorm.weight", "norm1", ("index", i)),
           (p + "post_attention_layernorm.weight", "norm2", ("index", i))]
    a = p + "self_attn."
    if i in cfg.mla_layers:
        out += [(a + "q_proj.weight", o + "q_proj", ()), (a + "kv_a_proj_with_mqa.weight", o + "kv_a", ()),
                (a + "kv_a_layernorm.weight", o + "kv_norm", ()), (a + "kv_b_proj.weight", o + "kv_b", ()),
                (a + "o_proj.weight", o + "o_proj", ())]
    else:
        for j, x in enumerate("qkv"):
            out.append((a + f"{x}_proj.weight", o + "qkv_proj", ("rows", j * HK, (j + 1) * HK)))
            out.append((a + f"{x}_conv1d.weight", o + "conv_weight", ("conv", j * HK, (j + 1) * HK)))
        out += [(a + "A_log", o + "A_log", ("view", (1, 1, H, 1))), (a + "dt_bias", o + "dt_bias", ()),
                (a + "f_a_proj.weight", o + "f_a", ()), (a + "f_b_proj.weight", o + "f_b", ()),
                (a + "b_proj.weight", o + "b_proj", ()), (a + "g_a_proj.weight", o + "g_a", ()),
                (a + "g_b_proj.weight", o + "g_b", ()), (a + "o_norm.weight", o + "o_norm", ()),
                (a + "o_proj.weight", o + "o_proj", ())]
    f = f"ffn.{i}."
    if cfg.is_moe_layer(i):
        m, F_ = p + "block_sparse_moe.", cfg.moe_intermediate_size
        out += [(m + "gate.weight", f + "router", ()), (m + "gate.e_score_correction_bias", f + "router_bias", ())]
        for e in range(cfg.num_experts):
            x = m + f"experts.{e}."
            out += [(x + "w1.weight", f + "experts_gate_up", ("expert", e, 0, F_)),
                    (x + "w3.weight", f + "experts_gate_up", ("expert", e, F_, 2 * F_)),
                    (x + "w2.weight", f + "experts_down", ("expert", e, None, None))]
        if cfg.num_shared_experts:
            Fs = F_ * cfg.num_shared_experts
            s = m + "shared_experts."
            out += [(s + "gate_proj.weight", f + "shared.gate_up", ("rows", 0, Fs)),
                    (s + "up_proj.weight", f + "shared.gate_up", ("rows", Fs, 2 * Fs)),
                    (s + "down_proj.weight", f + "shared.down", ())]
    else:
        F_ = cfg.intermediate_size
        out += [(p + "mlp.gate_proj.weight", f + "gate_up", ("rows", 0, F_)),
                (p + "mlp.up_proj.weight", f + "gate_up", ("rows", F_, 2 * F_)), (p + "mlp.down_proj.weight", f + "down", ())]
    return out


def transformers_dense_name(name: str) -> str:
    """The name transformers' ``KimiLinearForCausalLM.save_pretrained`` gives a dense layer's MLP tensor
    ``model.layers.{i}.mlp.*``: ``model.layers.{i}.block_sparse_moe.*``. Its ``conversion_mapping.py`` renames
    ``.block_sparse_moe.`` to ``.mlp.`` on load (its MoE and MLP modules share the ``mlp`` attribute) and reverses
    every rename on save, so the first ``first_k_dense_replace`` layers' dense MLP comes out under the MoE's prefix
    (seen with transformers 5.25). Moonshot's checkpoints and llama.cpp's converter use ``mlp.``: :func:`save`
    writes ``mlp.``, :func:`load` reads either. Other names are returned unchanged."""
    p, sep, rest = name.partition(".mlp.")
    return f"{p}.block_sparse_moe.{rest}" if sep and p.startswith("model.layers.") else name


def name_map(cfg: ModelConfig) -> list[tuple[str, str, tuple]]:
    """Every tensor of the checkpoint format of ``cfg``: (Moonshot name, our state-dict name, slice spec)."""
    out = [("model.embed_tokens.weight", "embed", ()), ("model.norm.weight", "norm_f", ()), ("lm_head.weight", "lm_head", ())]
    for i in range(cfg.num_layers):
        out += _layer_names(cfg, i)
    return out


def _part(t: torch.Tensor, spec: tuple) -> torch.Tensor:
    """The Moonshot tensor that ``spec`` cuts from our tensor ``t``."""
    if not spec:
        return t
    kind = spec[0]
    if kind == "index":
        return t[spec[1]]
    if kind == "rows":
        return t[spec[1]: spec[2]]
    if kind == "conv":
        return t[spec[1]: spec[2]].unsqueeze(1)                           # [HK, 1, W]
    if kind == "expert":
        return t[spec[1]] if spec[2] is None else t[spec[1], spec[2]: spec[3]]
    return t.reshape(spec[1])                                             # "view"


def to_hf_state(model) -> dict[str, torch.Tensor]:
    """The tensors of ``model`` (a ``HybridLM``) under Moonshot's names (views of the model's tensors)."""
    ours = model.state_dict()
    return {theirs: _part(ours[name], spec) for theirs, name, spec in name_map(model.cfg)}


def save(model, path, dtype: torch.dtype = torch.float32, max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Write ``model`` (a ``HybridLM``) to folder ``path`` in Kimi-Linear's format: ``config.json``, the weights cast
    to ``dtype`` (the router's weight and bias and ``dt_bias`` stay fp32, as Moonshot stores them), in one
    ``model.safetensors`` or in shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``.
    Returns the config dict. Raises ValueError for a dtype not in :data:`STORE_DTYPES`, a K != V model, or a
    weight that is not finite after the cast (an fp16 overflow)."""
    from safetensors.torch import save_file

    conf = hf_config(model.cfg, dtype)
    keep_fp32 = ("gate.weight", "e_score_correction_bias", "dt_bias")
    state = {n: t.detach().to(torch.float32 if n.endswith(keep_fp32) else dtype).contiguous().clone()
             for n, t in to_hf_state(model).items()}
    bad = [n for n, t in state.items() if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"weights {bad[:3]} are not finite in {dtype} (overflow); store bfloat16 or float32")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    for old in [out / WEIGHTS_NAME, out / INDEX_NAME, *out.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    shards, size = [[]], 0
    for n, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    if len(shards) == 1:
        save_file(state, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, names in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: state[n] for n in names}, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in names})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                 indent=2) + "\n")
    (out / CONFIG_NAME).write_text(json.dumps(conf, indent=2) + "\n")
    return conf


def _keys(path: Path) -> list[str]:
    """Tensor names in a safetensors file (its header only). Raises ValueError for a file that is not one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as e:                                                # safetensors' own error type varies
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None


def _weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index when there is one, else from ``model.safetensors``. Raises ValueError
    for an index that is not JSON, has no ``weight_map`` object, or maps a tensor to a file that is missing or does
    not hold it."""
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} must be JSON with a 'weight_map' object ({e!r})") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} field 'weight_map' must be an object (tensor name -> file), "
                             f"got {type(weight_map).__name__}")
        files, held = {}, {}
        for n, f in weight_map.items():
            if not isinstance(f, str) or "/" in f or not (folder / f).is_file():
                raise ValueError(f"{index} maps {n!r} to {f!r}, which is not a file in the folder")
            if f not in held:
                held[f] = set(_keys(folder / f))
            if n not in held[f]:
                raise ValueError(f"{index} maps {n!r} to {f!r}, which does not hold that tensor")
            files[n] = folder / f
        return files
    if not (folder / WEIGHTS_NAME).is_file():
        raise ValueError(f"path must be a model folder holding {WEIGHTS_NAME} or {INDEX_NAME}; neither is in {folder}")
    return dict.fromkeys(_keys(folder / WEIGHTS_NAME), folder / WEIGHTS_NAME)


def read_config(path) -> ModelConfig:
    """The :class:`ModelConfig` of a model folder's ``config.json`` (see :func:`config_from_hf`). Raises ValueError
    for a missing folder or file, bad JSON, or an unsupported config."""
    folder = Path(path)
    if not (folder / CONFIG_NAME).is_file():
        raise ValueError(f"path must be a model folder holding {CONFIG_NAME}; {folder / CONFIG_NAME} does not exist")
    try:
        d = json.loads((folder / CONFIG_NAME).read_text())
    except ValueError as e:
        raise ValueError(f"{folder / CONFIG_NAME} is not valid JSON ({e})") from None
    return config_from_hf(d, name=folder.name, source=f"checkpoint folder {folder.name}")


def load(path, cfg: ModelConfig, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read the weights of model folder ``path``, whose config is ``cfg`` (:func:`read_config`), into our state dict:
    fp32 tensors of the names and shapes of ``expected`` (the state dict of a ``HybridLM`` of ``cfg``, e.g. built on
    the meta device; the caller passes it, so this module does not import the model). Tensors are read one at a
    time (``safe_open``), each cast from its stored dtype as it is copied in.

    Raises ValueError for a missing weights file or a bad index, and every missing, unexpected or mis-shaped
    tensor (all named, the first few of each kind)."""
    from safetensors import safe_open

    folder = Path(path)
    files = _weight_files(folder)
    entries = name_map(cfg)
    stored = {}                                                           # Moonshot name -> name in the files
    for theirs, _, _ in entries:
        alias = transformers_dense_name(theirs)
        stored[theirs] = alias if theirs not in files and alias in files else theirs
    missing = sorted(theirs for theirs, n in stored.items() if n not in files)
    unexpected = sorted(set(files) - set(stored.values()))
    if missing or unexpected:
        raise ValueError(f"weights in {folder} do not match its config.json: missing {len(missing)} "
                         f"{_few(missing)}, unexpected {len(unexpected)} {_few(unexpected)}")
    state = {n: torch.empty(t.shape, dtype=torch.float32) for n, t in expected.items()}
    bad = []
    handles = {}
    try:
        for theirs, name, spec in entries:
            key = stored[theirs]
            fpath = files[key]
            if fpath not in handles:
                handles[fpath] = safe_open(str(fpath), framework="pt")
            t = handles[fpath].get_tensor(key)
            target = _part(state[name], spec)
            if tuple(t.shape) != tuple(target.shape):
                bad.append(f"{key} {tuple(t.shape)} (need {tuple(target.shape)})")
                continue
            if not t.is_floating_point():
                bad.append(f"{key} dtype {t.dtype} (need a float)")
                continue
            target.copy_(t.reshape(target.shape))
    finally:
        handles.clear()
    if bad:
        raise ValueError(f"weights in {folder} have the wrong shape or dtype for its config.json: {_few(bad)}")
    return state


def _few(names: list[str], n: int = 5) -> str:
    return "[]" if not names else "[" + ", ".join(names[:n]) + (", ..." if len(names) > n else "") + "]"
