"""Small Llama GGUF files written as llama.cpp's converter writes them, by the gguf
package's own writer: a Llama's weights (Hugging Face's names) renamed to GGUF's, q and k
permuted to llama.cpp's rotary order (its converter's `permute`, the reference the import
must undo), optionally quantized, with a tiny byte-level BPE vocabulary in the metadata.
Without the gguf package the test is skipped (failed under --require hf)."""

import numpy as np
from harness import required


def gguf_module():
    try:
        import gguf
    except ImportError:
        required.missing("hf", "the gguf package is not installed: pip install gguf")
    return gguf


def permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from Hugging
    Face's halves to interleaved pairs."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight"}


def gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def byte_vocabulary(size: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a byte-level BPE of `size` tokens: <|endoftext|>
    (a control token), the 256 bytes in GPT-2's alphabet, merges of the first ones."""
    from hpcpipe.data.tokenizer import _byte_alphabet

    alphabet = [_byte_alphabet()[b] for b in range(256)]
    tokens, merges = ["<|endoftext|>"] + alphabet, []
    for a, b in zip("tthhe ", "hee  t"):
        if len(tokens) >= size:
            break
        pair = a.replace(" ", "Ġ") + b.replace(" ", "Ġ")
        if pair not in tokens:
            tokens.append(pair)
            merges.append(f"{a.replace(' ', 'Ġ')} {b.replace(' ', 'Ġ')}")
    tokens += [f"<unused{i}>" for i in range(size - len(tokens))]
    types = [3] + [1] * (size - 1)
    return tokens[:size], merges, types


def write(path, cfg, state: dict, quant: str = "F32", pre: str = "smollm",
          extra=None) -> None:
    """A GGUF file at `path` of the Llama shape `cfg` holding `state` (Hugging Face names:
    float32 arrays); quant: the ggml type of the matrices ("F32", "Q8_0", ...; the norms
    stay F32, as llama.cpp keeps them). extra(writer): more metadata, for tests."""
    gguf = gguf_module()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.block_size)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(cfg.ffn_width)
    writer.add_head_count(cfg.n_head)
    writer.add_head_count_kv(cfg.kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(cfg.n_embd // cfg.n_head)
    tokens, merges, types = byte_vocabulary(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    if extra is not None:
        extra(writer)
    kind = getattr(gguf.GGMLQuantizationType, quant)
    for name, value in state.items():
        value = np.asarray(value, dtype=np.float32)
        if name.endswith("q_proj.weight"):
            value = permute(value, cfg.n_head)
        elif name.endswith("k_proj.weight"):
            value = permute(value, cfg.kv_heads)
        if value.ndim == 2 and quant != "F32":
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(value, kind),
                              raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
