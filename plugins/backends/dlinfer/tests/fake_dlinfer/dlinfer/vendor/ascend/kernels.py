"""Torch stand-ins for the torch_npu / ATB kernels the Ascend vendor calls,
on the layouts those kernels read and write. Only what the vendor code
reaches is modelled; each stand-in checks the shapes and dtypes the call
site hands it.

The page size rule: dlinfer itself asserts nothing about ``block_size``; the
paged kernels' constraint is enforced by LMDeploy, its only caller,
lmdeploy/messages.py:532-535 (InternLM/lmdeploy 1263d5cd): ``kernel_block_size
>= 16 and a power of 2`` (and 16 exactly on camb, :546-550). The fake's
paged kernels refuse any other block size, as the NPU's do.
"""
import torch


def check_block_size(block_size: int) -> None:
    assert block_size >= 16 and (block_size & (block_size - 1)) == 0, (
        f"block_size must be >= 16 and a power of 2, but got {block_size}"
    )


def reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """torch.ops.atb._npu_reshape_and_cache: key/value [T, Hkv, D] into
    caches [num_blocks, block_size, Hkv, D] at flat slots (int32)."""
    assert slot_indices.dtype == torch.int32, slot_indices.dtype
    assert key_cache.dim() == 4 and value_cache.dim() == 4, "caches are [num_blocks, block_size, num_kv_heads, head_size]"
    assert key.dim() == 3 and tuple(key_cache.shape[2:]) == tuple(key.shape[1:]), (key.shape, key_cache.shape)
    assert tuple(value_cache.shape[2:]) == tuple(value.shape[1:]), (value.shape, value_cache.shape)
    assert key.is_contiguous() and value.is_contiguous()
    assert slot_indices.numel() == key.shape[0], (slot_indices.shape, key.shape)
    total = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_indices.long()
    assert bool(((slots >= 0) & (slots < total)).all()), "slot out of range"
    key_cache.view(total, *key_cache.shape[2:])[slots] = key.to(key_cache.dtype)
    value_cache.view(total, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)


def _attend(q, k, v, scale, mask_upper_from=None):
    """q [n, Hq, D], k/v [s, Hkv, D]: softmax(q k^T * scale) v in float32;
    query row i sees keys j <= mask_upper_from + i when given (causal)."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if mask_upper_from is not None:
        n, s = q.shape[0], k.shape[0]
        allowed = torch.arange(s)[None, :] <= (torch.arange(n)[:, None] + mask_upper_from)
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
    out = torch.matmul(scores.softmax(-1), vf)
    return out.transpose(0, 1)


def fused_infer_attention_score(
    *, query, key, value, atten_mask, block_table, input_layout, block_size, actual_seq_lengths,
    actual_seq_lengths_kv, num_key_value_heads, num_heads, scale, sparse_mode,
):
    """torch.ops.npu.npu_fused_infer_attention_score, TND layout, paged K/V
    [num_blocks, block_size, Hkv * D]: actual_seq_lengths is cumulative over
    the query tokens (TND), actual_seq_lengths_kv per sequence. sparse_mode
    0 without a mask: every query sees all its keys (decode); 3: the
    bottom-right causal mask, given as the 2048 x 2048 upper triangle.
    Returns (attention_out, softmax_lse)."""
    assert input_layout == "TND", input_layout
    check_block_size(block_size)
    assert block_table.dtype == torch.int32, block_table.dtype
    assert key.dim() == 3 and key.shape[1] == block_size, key.shape
    assert query.dim() == 3 and query.shape[1] == num_heads, query.shape
    assert num_heads % num_key_value_heads == 0
    if sparse_mode == 3:
        assert atten_mask is not None and tuple(atten_mask.shape) == (2048, 2048) and atten_mask.dtype == torch.bool, (
            "sparse_mode 3 takes the 2048 x 2048 bool upper triangle (lmdeploy ascend op_backend.py:266-268)"
        )
    else:
        assert sparse_mode == 0 and atten_mask is None, (sparse_mode, atten_mask)
    ends = [int(x) for x in torch.as_tensor(actual_seq_lengths).tolist()]
    kv_lens = [int(x) for x in torch.as_tensor(actual_seq_lengths_kv).tolist()]
    assert len(ends) == len(kv_lens) and ends[-1] == query.shape[0], (ends, kv_lens, query.shape)
    head = query.shape[-1]
    kv = key.view(key.shape[0] * block_size, num_key_value_heads, -1)
    vv = value.view(value.shape[0] * block_size, num_key_value_heads, -1)
    assert kv.shape[-1] == head
    out = query.new_empty(query.shape[0], num_heads, vv.shape[-1])
    start = 0
    for i, (end, s) in enumerate(zip(ends, kv_lens)):
        n = end - start
        assert 0 <= n <= s, (n, s)
        pages = block_table[i, : -(-s // block_size)].long()
        slots = (pages[:, None] * block_size + torch.arange(block_size, device=pages.device)[None, :]).reshape(-1)[:s]
        causal_from = s - n if sparse_mode == 3 else None
        out[start:end] = _attend(query[start:end], kv[slots], vv[slots], scale, causal_from).to(query.dtype)
        start = end
    return out, None


def flash_attention(*, query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out):
    """torch.ops.atb._npu_flash_attention: contiguous prefill, sequences
    concatenated along tokens, per-sequence lengths in seq_len; mask nonzero
    above the diagonal hides the future. Writes into out."""
    lens = [int(x) for x in torch.as_tensor(seq_len).tolist()]
    assert sum(lens) == query.shape[0] == key.shape[0], (lens, query.shape, key.shape)
    assert query.shape[1] == num_heads and key.shape[1] == num_kv_heads
    assert mask.shape[-1] >= max(lens) and mask.shape[-2] >= max(lens), (mask.shape, lens)
    upper = torch.triu(torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device), diagonal=1)
    assert torch.equal(mask != 0, upper), "the mask is the strict upper triangle"
    start = 0
    for n in lens:
        out[start : start + n] = _attend(query[start : start + n], key[start : start + n], value[start : start + n], scale_value, 0).to(out.dtype)
        start += n


def rotate_half_apply(query, key, cos, sin):
    """torch.ops.npu.npu_apply_rotary_pos_emb(q, k, cos, sin, "BSND"): the
    same arithmetic as the vendor's own fallback (torch_npu_ops.py:137-142)."""

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    return (query * cos) + (rotate_half(query) * sin), (key * cos) + (rotate_half(key) * sin)


def moe_init_routing_and_mlp(hidden_states, gate_up_weights, down_weights, topk_ids, num_experts):
    """npu_moe_init_routing_v2 + npu_grouped_matmul (gate_up^T) + npu_swiglu +
    npu_grouped_matmul (down^T): the expert output of every (token, k) pair,
    [T, K, H], rows of tokens grouped by expert as the kernels group them."""
    t, k = topk_ids.shape
    assert topk_ids.dtype == torch.int32, topk_ids.dtype
    assert bool(((topk_ids >= 0) & (topk_ids < num_experts)).all()), (
        "expert ids outside active_expert_range [0, num_experts) (moe.py:384)"
    )
    e, two_i, h = gate_up_weights.shape
    assert down_weights.shape[0] == e and down_weights.shape[1] == h and 2 * down_weights.shape[2] == two_i, (
        gate_up_weights.shape, down_weights.shape,
    )
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    rows = hidden_states[order // k]
    counts = torch.bincount(flat, minlength=e).tolist()
    outs = []
    start = 0
    for expert, n in enumerate(counts):
        if n:
            x = rows[start : start + n]
            up = x @ gate_up_weights[expert].transpose(0, 1)
            gate, upv = up.chunk(2, -1)
            act = torch.nn.functional.silu(gate) * upv
            outs.append(act @ down_weights[expert].transpose(0, 1))
        start += n
    expert_out = torch.cat(outs) if outs else rows.new_zeros(0, h)
    unsorted = torch.empty_like(expert_out)
    unsorted[order] = expert_out
    return unsorted.view(t, k, h)
