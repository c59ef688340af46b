"""The wire protocol between rank 0 and the other ranks of a multi-process
engine: what crosses the control group each step.

Every step rank 0 sends each rank its dp group's batch by one collective on
the control group: a header all-reduce (``control``: the op and the payload's
length), then one int64 broadcast (``pack_step``): token ids, positions,
sequence and query lengths, slot mapping, block tables and pending page
copies of each KV-cache group, the logits rows to compute, the group's
``SampleJob`` (``encode_job``: sampling parameters, token ids for penalties,
grammar masks, the uniforms of seeded rows drawn on rank 0 from the
requests' generators), and the step's decode flag (decode only when every dp
group decodes, so DeepEP's low-latency mode agrees across the expert group).
A dp group with nothing to run gets no part and does a one-token dummy
forward into a scratch page of each KV-cache group (``dummy_step``), so the
expert all-to-all never waits for it. The first tp rank of each dp group but
0 samples its rows where its logits are and sends back only the sampled ids
and requested logprobs (``send_result``).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from plinth.api import AttentionMetadata
from plinth.engine.grammar import FixedMask
from plinth.engine.model_runner import ModelRunner
from plinth.engine.sampler import SampleJob, SampleResult, SampleRow, random_rows, uniforms

#: the header's ops: a heartbeat, a step (a payload follows), stop
OP_NOOP, OP_STEP, OP_STOP = 0, 1, 2


#: per dp group: tokens, sequences, logits rows, longest query, bytes of its
#: SampleJob; then per KV-cache group: widest block table, page copies
_HEAD = 5


@dataclass
class StepPart:
    """Dp group d's part of one step, as every rank of the group runs it."""

    ids: torch.Tensor
    #: with more than one KV-cache group, ``meta.groups`` holds each group's block tables and slots
    meta: AttentionMetadata
    #: the flat token rows whose logits the step needs
    rows: list[int]
    #: per KV-cache group, the pages to copy (src, dst) before the forward (n > 1 forks)
    copies: list[list[tuple[int, int]]] = field(default_factory=list)
    #: the encoded SampleJob its first tp rank runs (empty for group 0: rank 0 samples it)
    job: bytes = b""


def group_metas(meta: AttentionMetadata) -> list[AttentionMetadata]:
    return meta.groups or [meta]


def _int64_words(data: bytes) -> np.ndarray:
    return np.frombuffer(data + b"\0" * (-len(data) % 8), dtype=np.int64)


def pack_step(parts: list[StepPart | None], decode: bool, num_groups: int) -> torch.Tensor:
    """parts[d]: dp group d's part, or None (it runs a dummy forward)."""
    head: list[np.ndarray] = [np.array([int(decode)], dtype=np.int64)]
    body: list[np.ndarray] = []
    for part in parts:
        if part is None:
            head.append(np.zeros(_HEAD + 2 * num_groups, dtype=np.int64))
            continue
        m, metas = part.meta, group_metas(part.meta)
        copies = part.copies or [[] for _ in metas]
        head.append(np.array(
            [part.ids.numel(), m.num_seqs, len(part.rows), m.max_query_len, len(part.job),
             *(g.block_tables.shape[1] for g in metas), *(len(c) for c in copies)], dtype=np.int64,
        ))  # fmt: skip
        body += [
            part.ids.cpu().numpy(), m.positions.cpu().numpy(), np.asarray(m.seq_lens_cpu), np.asarray(m.query_lens_cpu),
            np.asarray(part.rows), _int64_words(part.job),
        ]  # fmt: skip
        for g, c in zip(metas, copies):
            body += [g.slot_mapping.cpu().numpy(), g.block_tables.cpu().numpy().ravel(), np.asarray(c).reshape(-1)]
    return torch.from_numpy(np.concatenate([a.astype(np.int64, copy=False) for a in head + body]))


def unpack_step(payload: torch.Tensor, dp: int, dp_rank: int, num_groups: int) -> tuple[bool, list[np.ndarray] | None]:
    """(decode, this group's head and arrays, or None when it has no part)."""
    x = payload.numpy()
    width = _HEAD + 2 * num_groups
    heads = x[1 : 1 + dp * width].reshape(dp, width)
    off = 1 + dp * width
    mine = None
    for d in range(dp):
        t, b, r, _, nbytes = (int(v) for v in heads[d][:_HEAD])
        if t == 0:
            continue
        pages, copies = heads[d][_HEAD : _HEAD + num_groups], heads[d][_HEAD + num_groups :]
        sizes = [t, t, b, b, r, -(-nbytes // 8)] + [n for p, c in zip(pages, copies) for n in (t, b * int(p), 2 * int(c))]
        if d == dp_rank:
            mine = [heads[d]]
            for n in sizes:
                mine.append(x[off : off + n])
                off += n
        else:
            off += sum(sizes)
    return bool(x[0]), mine


def part_from(arrays: list[np.ndarray], runner: ModelRunner, decode: bool) -> StepPart:
    """A worker's StepPart from what ``unpack_step`` cut out for it."""
    head, ids, pos, seq_lens, q_lens, rows, job, *per_group = arrays
    b, dev = int(head[1]), runner.device
    cu = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(q_lens, out=cu[1:])
    shared: dict[str, Any] = dict(
        positions=torch.from_numpy(pos.copy()).to(dev), query_start_loc=torch.from_numpy(cu).to(dev),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev), page_size=runner.page_size,
        max_query_len=int(head[3]), max_seq_len=int(seq_lens.max()), query_lens_cpu=q_lens.tolist(),
        seq_lens_cpu=seq_lens.tolist(), moe_decode=decode,
    )  # fmt: skip
    metas, copies = [], []
    for gi in range(len(per_group) // 3):
        slots, tables, pairs = per_group[3 * gi : 3 * gi + 3]
        table = torch.from_numpy(tables.reshape(b, int(head[_HEAD + gi])).astype(np.int32)).to(dev)
        metas.append(AttentionMetadata(slot_mapping=torch.from_numpy(slots.copy()).to(dev), block_tables=table, **shared))
        copies.append([(int(s), int(d)) for s, d in pairs.reshape(-1, 2)])
    meta = metas[0]
    if len(metas) > 1:
        meta.groups, meta.layer_groups = metas, runner.layer_groups
    return StepPart(torch.from_numpy(ids.copy()).to(dev), meta, rows.tolist(), copies, job.tobytes()[: int(head[4])])


def dummy_step(runner: ModelRunner, scratch: list[int], decode: bool) -> StepPart:
    """One token written into each KV-cache group's scratch page: a dp
    group with no work still joins the expert all-to-all of every MoE layer."""
    dev, ps = runner.device, runner.page_size
    shared: dict[str, Any] = dict(
        positions=torch.zeros(1, dtype=torch.long, device=dev), query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
        seq_lens=torch.ones(1, dtype=torch.int32, device=dev), page_size=ps, max_query_len=1, max_seq_len=1,
        query_lens_cpu=[1], seq_lens_cpu=[1], moe_decode=decode,
    )  # fmt: skip
    metas = [
        AttentionMetadata(
            slot_mapping=torch.full((1,), page * ps, dtype=torch.long, device=dev),
            block_tables=torch.full((1, 1), page, dtype=torch.int32, device=dev), **shared,
        )
        for page in scratch
    ]  # fmt: skip
    meta = metas[0]
    if len(metas) > 1:
        meta.groups, meta.layer_groups = metas, runner.layer_groups
    return StepPart(torch.zeros(1, dtype=torch.long, device=dev), meta, [])


# ---- a dp group's sampling on its own rank ---------------------------------------------------


def encode_job(job: SampleJob, vocab: int) -> bytes:
    """A dp group's SampleJob for its rank: each row's parameters and token
    ids, a grammar as its mask (bits) and the uniforms of the random rows,
    drawn here from the requests' generators in the order one process draws
    them (a seeded request samples the same tokens at any dp)."""
    rand = random_rows(job.rows)
    u = uniforms([job.rows[i].generator for i in rand]).tolist() if rand else []
    rows = [
        (r.params.clone(grammar=None), list(r.prompt_ids), list(r.output_ids), list(r.banned),
         None if r.grammar is None else np.packbits(FixedMask.of(r.grammar, vocab).forbidden.cpu().numpy()).tobytes())
        for r in job.rows
    ]  # fmt: skip
    return pickle.dumps((rows, job.at, job.prompt, u), protocol=pickle.HIGHEST_PROTOCOL)


def decode_job(data: bytes, vocab: int) -> SampleJob:
    wire, at, prompt, u = pickle.loads(data)
    rows = [
        SampleRow(
            params=params, prompt_ids=prompt_ids, output_ids=output_ids, generator=None, banned=banned,
            grammar=None if bits is None else FixedMask(torch.from_numpy(np.unpackbits(np.frombuffer(bits, dtype=np.uint8))[:vocab].astype(bool))),
        )
        for params, prompt_ids, output_ids, banned, bits in wire
    ]  # fmt: skip
    return SampleJob(rows, at, prompt, torch.tensor(u, dtype=torch.float64) if u else None)


def send_result(result: SampleResult, ctrl: Any) -> None:
    """To rank 0: the byte count, then the pickled SampleResult (ids and logprobs)."""
    import torch.distributed as dist

    data = pickle.dumps((result.tokens, result.logprobs, result.prompt_logprobs), protocol=pickle.HIGHEST_PROTOCOL)
    dist.send(torch.tensor([len(data)], dtype=torch.long), dst=0, group=ctrl)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=ctrl)


def receive_result(src: int, ctrl: Any) -> tuple[SampleResult, int]:
    """(what ``send_result`` sent from rank src, the bytes that crossed)."""
    import torch.distributed as dist

    n = torch.zeros(1, dtype=torch.long)
    dist.recv(n, src=src, group=ctrl)
    data = torch.empty(int(n[0]), dtype=torch.uint8)
    dist.recv(data, src=src, group=ctrl)
    return SampleResult(*pickle.loads(data.numpy().tobytes())), n.element_size() + data.numel()



def control(header: torch.Tensor, ctrl: Any) -> None:
    """The header all-reduce (MAX: workers give zeros): unlike a broadcast,
    the sender waits for every rank, so a stopped rank is noticed too."""
    import torch.distributed as dist

    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=ctrl)
