"""EAGLE-2 dynamic draft trees: the head's draft loop, batched over requests and tree nodes.

From each request's last committed entry the head proposes the top-k tokens (level 0). Each
further step runs the head ONCE over the frontier of every request (k rows per request: the
k best nodes of the previous level by cumulative draft log-probability), each row attending
to the request's committed head KV plus the loop entries of its own ancestors (a tree mask
over preallocated loop buffers: nothing is written to the pool). Every frontier node offers
its top-k children as candidates (k x k per level, scored by cumulative log-probability);
the next frontier is the best k of them. At the end all candidates are reranked by score and
the best `num_nodes` kept: a child's score never exceeds its parent's, so the kept set is a
tree (a rare tie is repaired on the host). With k = 1 this is exactly the greedy chain.

The kept tokens are the head's deterministic top-k picks, so for rejection sampling at
temperature > 0 each node's draft distribution is one-hot (SpecInfer / SGLang's
"target-only" tree sampling: accept child x with probability p'(x), else drop x from p' and
renormalize); the head's soft probabilities would bias the output, since the tokens were
not drawn from them.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from loom.runtime.forward_batch import forward_context


class TreeAttention:
    """Attention of the draft loop: per head layer, one buffer [b, Hkv, L + steps * k, D]
    holding the committed entries (gathered from the head's pool once per loop) and room
    for the loop's own entries; `mask` [b, k, L + steps * k] says which columns each
    frontier row sees (committed, its ancestors' entries, itself)."""

    def __init__(self, kv, slots: torch.Tensor, committed: torch.Tensor, topk: int, steps: int):
        b, width = slots.shape
        self.kv, self.slots, self.k, self.width = kv, slots, topk, width
        cols = width + max(0, steps - 1) * topk
        self.mask = torch.zeros(b, topk, cols, dtype=torch.bool, device=slots.device)
        self.mask[:, :, :width] = committed[:, None, :]
        self.eye = torch.eye(topk, dtype=torch.bool, device=slots.device)
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.end = width  # columns in use after the current level's entries

    def start_level(self, level: int, ancestors: torch.Tensor) -> None:
        """Loop call `level` (0-based) writes columns width + level * k ..; `ancestors`
        [b, k, level * k]: which earlier loop entries each frontier row descends from."""
        lo = self.width + level * self.k
        self.mask[:, :, self.width : lo] = ancestors
        self.mask[:, :, lo : lo + self.k] = self.eye
        self.end = lo + self.k

    def forward(self, q, k, v, layer, batch):
        b, n = self.slots.shape[0], self.k
        bufs = self.buffers.get(layer.layer_id)
        if bufs is None:
            cols = self.mask.shape[2]
            bufs = []
            for src in self.kv.get_kv(layer.layer_id):
                buf = torch.empty(b, cols, *src.shape[1:], dtype=q.dtype, device=q.device)
                buf[:, : self.width] = src[self.slots.reshape(-1)].view(
                    b, self.width, *src.shape[1:]
                )
                bufs.append(buf)
            bufs = self.buffers[layer.layer_id] = tuple(bufs)
        lo = self.end - n
        bufs[0][:, lo : self.end] = k.view(b, n, *k.shape[1:])
        bufs[1][:, lo : self.end] = v.view(b, n, *v.shape[1:])
        out = F.scaled_dot_product_attention(
            q.view(b, n, *q.shape[1:]).transpose(1, 2),
            bufs[0][:, : self.end].transpose(1, 2),
            bufs[1][:, : self.end].transpose(1, 2),
            attn_mask=self.mask[:, None, :, : self.end],
            scale=layer.scaling,
            enable_gqa=layer.is_gqa,
        )
        return out.transpose(1, 2).reshape(b * n, *q.shape[1:])


def grow_trees(
    head, hidden: torch.Tensor, seq: torch.Tensor, attn: TreeAttention | None, steps: int,
    topk: int, num_nodes: int,
) -> list[tuple[list[int], list[int]]]:  # fmt: skip
    """hidden [b, H]: the head's output at each request's last committed entry (at rotary
    position seq - 1); `attn`: the loop's attention (None when steps == 1). Returns per
    request (target token ids, parents) of at most `num_nodes` nodes, parents first (-1: the
    request's last real token). One device -> host copy."""
    b, h = hidden.shape
    kk = topk
    logp = torch.log_softmax(head.logits(hidden), dim=-1)
    score, ids = logp.topk(kk, dim=-1)  # [b, k]
    scores, tokens = [score], [ids]
    parents = [torch.full((b, kk), -1, dtype=torch.int64, device=hidden.device)]
    front_score, front_ids = score, ids
    front_node = torch.arange(kk, device=hidden.device).expand(b, kk)
    front_hidden = hidden[:, None, :].expand(b, kk, h)
    ancestors = torch.zeros(b, kk, 0, dtype=torch.bool, device=hidden.device)
    count = kk
    with forward_context(SimpleNamespace(attn_backend=attn)):
        for level in range(steps - 1):
            attn.start_level(level, ancestors)
            pos = (seq + level)[:, None].expand(b, kk).reshape(-1)
            out = head(
                pos, head.to_target_ids(front_ids).reshape(-1), front_hidden.reshape(-1, h), False
            )
            logp = torch.log_softmax(head.logits(out), dim=-1)
            s, t = logp.view(b, kk, -1).topk(kk, dim=-1)  # [b, k, k]
            s = (s + front_score[:, :, None]).view(b, kk * kk)
            t = t.view(b, kk * kk)
            scores.append(s)
            tokens.append(t)
            parents.append(front_node[:, :, None].expand(b, kk, kk).reshape(b, kk * kk))
            if level + 2 < steps:  # the next frontier: the best k of these candidates
                front_score, pick = s.topk(kk, dim=-1)
                src = pick // kk
                front_ids = t.gather(1, pick)
                front_node = count + pick
                front_hidden = out.view(b, kk, h).gather(1, src[:, :, None].expand(b, kk, h))
                width = ancestors.shape[2]
                ancestors = torch.cat(
                    [
                        ancestors.gather(1, src[:, :, None].expand(b, kk, width)),
                        F.one_hot(src, kk).bool(),
                    ],
                    dim=2,
                )
            count += kk * kk
    all_scores = torch.cat(scores, dim=1)
    keep = min(num_nodes, count)
    chosen = all_scores.topk(keep, dim=-1).indices.sort(dim=-1).values  # parents come first
    chosen_tokens = head.to_target_ids(torch.cat(tokens, dim=1).gather(1, chosen))
    chosen_parents = torch.cat(parents, dim=1).gather(1, chosen)
    rows = torch.stack([chosen, chosen_tokens, chosen_parents]).tolist()
    return [_reindex(*per_req) for per_req in zip(*rows)]


def _reindex(ids: list[int], toks: list[int], pars: list[int]) -> tuple[list[int], list[int]]:
    """Candidate numbering -> node indices; a node whose parent was not kept (a score tie)
    is dropped with its subtree."""
    index = {-1: -1}
    out_tokens, out_parents = [], []
    for cand, tok, par in zip(ids, toks, pars):
        if par in index:
            index[cand] = len(out_tokens)
            out_tokens.append(tok)
            out_parents.append(index[par])
    return out_tokens, out_parents


def graft_forced(
    tokens: list[int], parents: list[int], forced: list[int]
) -> tuple[list[int], list[int]]:
    """The grammar's forced text as a chain of nodes, followed by the head's subtree below the
    node that ends the same text (when the tree holds that whole path), else nothing more."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, par) in enumerate(zip(tokens, parents)):
        children.setdefault(par, {}).setdefault(tok, i)
    node = -1
    for tok in forced:
        node = children.get(node, {}).get(tok)
        if node is None:
            break
    out_tokens = list(forced)
    out_parents = list(range(-1, len(forced) - 1))
    if node is None:
        return out_tokens, out_parents
    index = {node: len(forced) - 1}
    for i in range(node + 1, len(tokens)):  # descendants come after their ancestor
        if parents[i] in index:
            index[i] = len(out_tokens)
            out_tokens.append(tokens[i])
            out_parents.append(index[parents[i]])
    return out_tokens, out_parents
