"""Write a zoo model's own (seeded) weights as a GGUF file, for llama.cpp as a decode peer.

The ``gguf`` package (llama.cpp's own writer) does the file format; this module maps the Hugging Face
tensors to llama.cpp's names and layouts the way llama.cpp's ``convert_hf_to_gguf.py`` does: Llama's
``q_proj``/``k_proj`` rows are permuted from HF's half-split rotary layout to llama.cpp's interleaved one;
GPT-2's ``Conv1D`` weights (``[in, out]``) are transposed. The vocabulary is a placeholder list of the
model's size in llama.cpp's SPM kind for both families (the peers are fed token ids, never text), with the
config's BOS/EOS ids.

Types: ``f32`` (every tensor fp32), ``q8_0`` or ``q4_0`` (2-D weight matrices in llama.cpp's Q8_0 / Q4_0 blocks of
32, quantized by ``gguf.quants``; norms, biases and embeddings of positions stay fp32). Q4_0 is llama.cpp's 4-bit
counterpart of hetforge's ``--quantize w4`` (one scale per 32 weights; hetforge's default group is 128).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hetforge.errors import UsageError

TYPES = ("f32", "q8_0", "q4_0")
_GGML = {"q8_0": "Q8_0", "q4_0": "Q4_0"}  # qtype -> gguf.GGMLQuantizationType name
_FILE = {"f32": "ALL_F32", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}  # qtype -> gguf.LlamaFileType name


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary layout (first half / second half of each head) → llama.cpp's (pairs), as its converter."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().contiguous().numpy()


def _llama_tensors(model, cfg) -> list[tuple[str, np.ndarray]]:
    sd = model.state_dict()
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    out = [("token_embd.weight", _np(sd["model.embed_tokens.weight"])),
           ("output_norm.weight", _np(sd["model.norm.weight"])),
           ("output.weight", _np(sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out += [(f"blk.{i}.attn_norm.weight", _np(sd[p + "input_layernorm.weight"])),
                (f"blk.{i}.attn_q.weight", _permute(_np(sd[p + "self_attn.q_proj.weight"]), nh)),
                (f"blk.{i}.attn_k.weight", _permute(_np(sd[p + "self_attn.k_proj.weight"]), nkv)),
                (f"blk.{i}.attn_v.weight", _np(sd[p + "self_attn.v_proj.weight"])),
                (f"blk.{i}.attn_output.weight", _np(sd[p + "self_attn.o_proj.weight"])),
                (f"blk.{i}.ffn_norm.weight", _np(sd[p + "post_attention_layernorm.weight"])),
                (f"blk.{i}.ffn_gate.weight", _np(sd[p + "mlp.gate_proj.weight"])),
                (f"blk.{i}.ffn_up.weight", _np(sd[p + "mlp.up_proj.weight"])),
                (f"blk.{i}.ffn_down.weight", _np(sd[p + "mlp.down_proj.weight"]))]
    return out


def _gpt2_tensors(model, cfg) -> list[tuple[str, np.ndarray]]:
    sd = model.state_dict()
    out = [("token_embd.weight", _np(sd["transformer.wte.weight"])),
           ("position_embd.weight", _np(sd["transformer.wpe.weight"])),
           ("output_norm.weight", _np(sd["transformer.ln_f.weight"])),
           ("output_norm.bias", _np(sd["transformer.ln_f.bias"])),
           ("output.weight", _np(sd.get("lm_head.weight", sd["transformer.wte.weight"])))]
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        out += [(f"blk.{i}.attn_norm.weight", _np(sd[p + "ln_1.weight"])),
                (f"blk.{i}.attn_norm.bias", _np(sd[p + "ln_1.bias"])),
                (f"blk.{i}.attn_qkv.weight", _np(sd[p + "attn.c_attn.weight"]).T.copy()),
                (f"blk.{i}.attn_qkv.bias", _np(sd[p + "attn.c_attn.bias"])),
                (f"blk.{i}.attn_output.weight", _np(sd[p + "attn.c_proj.weight"]).T.copy()),
                (f"blk.{i}.attn_output.bias", _np(sd[p + "attn.c_proj.bias"])),
                (f"blk.{i}.ffn_norm.weight", _np(sd[p + "ln_2.weight"])),
                (f"blk.{i}.ffn_norm.bias", _np(sd[p + "ln_2.bias"])),
                (f"blk.{i}.ffn_up.weight", _np(sd[p + "mlp.c_fc.weight"]).T.copy()),
                (f"blk.{i}.ffn_up.bias", _np(sd[p + "mlp.c_fc.bias"])),
                (f"blk.{i}.ffn_down.weight", _np(sd[p + "mlp.c_proj.weight"]).T.copy()),
                (f"blk.{i}.ffn_down.bias", _np(sd[p + "mlp.c_proj.bias"]))]
    return out


def write_gguf(loaded, path: str | Path, qtype: str = "f32") -> Path:
    """Write ``loaded`` (a zoo ``LoadedModel`` of family llama or gpt2) to ``path`` as GGUF of type ``qtype``."""
    import gguf

    if qtype not in TYPES:
        raise UsageError(f"unknown GGUF type '{qtype}'; allowed: {', '.join(TYPES)}")
    cfg, fam = loaded.config, loaded.family
    if fam not in ("llama", "gpt2"):
        raise UsageError(f"GGUF export covers the llama and gpt2 families, not '{fam}'")
    path = Path(path)
    w = gguf.GGUFWriter(str(path), fam)
    w.add_name(loaded.name)
    w.add_file_type(getattr(gguf.LlamaFileType, _FILE[qtype]))
    if fam == "llama":
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_block_count(cfg.num_hidden_layers)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 1e4))
        w.add_rope_freq_base(float(theta))
        w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        tensors = _llama_tensors(loaded.model, cfg)
        w.add_tokenizer_model("llama")
    else:
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_block_count(cfg.n_layer)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(float(cfg.layer_norm_epsilon))
        tensors = _gpt2_tensors(loaded.model, cfg)
        # llama.cpp's BPE vocabulary ("gpt2") refuses a file without merges, and the gguf writer drops an empty
        # merge list; the placeholder vocabulary is never used to tokenize (ids are fed), so take the SPM kind
        w.add_tokenizer_model("llama")
    n = loaded.vocab_size
    w.add_vocab_size(n)
    w.add_token_list([f"<t{i}>" for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([gguf.TokenType.NORMAL] * n)
    bos, eos = getattr(cfg, "bos_token_id", None), getattr(cfg, "eos_token_id", None)
    if isinstance(bos, int):
        w.add_bos_token_id(bos)
    if isinstance(eos, int):
        w.add_eos_token_id(eos)
    for name, arr in tensors:
        if qtype in _GGML and arr.ndim == 2 and arr.shape[-1] % 32 == 0 and name != "position_embd.weight":
            kind = getattr(gguf.GGMLQuantizationType, _GGML[qtype])
            q = gguf.quants.quantize(arr, kind)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=kind)
        else:
            w.add_tensor(name, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
