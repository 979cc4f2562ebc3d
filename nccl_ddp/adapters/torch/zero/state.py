"""Optimizer state of `ZeroRedundancyOptimizer` between torch's format and the shard core's.

torch's format (an unsharded optimizer's `state_dict()`): {"state": {id: {key: tensor shaped like
the parameter, or a 0-dim tensor}}, "param_groups": [{hyperparameters..., "params": [ids]}]}, ids
numbering the parameters across the groups. Low-precision parameters add "fp32_master": {id:
fp32 tensor}, which torch's own optimizers ignore. The core's (zero/checkpoint.py): per piece
{key: flat array or float}, per layout index for the full state.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import torch

from nccl_ddp.adapters.torch.tensors import from_native, to_native
from nccl_ddp.errors import ConfigError

MASTER = "__fp32_master__"


def local_state(inner: Any, piece_params: List[Any], shard_memory: Any) -> Dict[int, Dict[str, Any]]:
    """This rank's piece states for consolidation (pieces of low-precision buckets carry their
    fp32 master beside the optimizer's state)."""
    out: Dict[int, Dict[str, Any]] = {}
    for k, t in enumerate(piece_params):
        state = inner.state.get(t)
        if not state:
            continue
        s: Dict[str, Any] = {}
        for key, v in state.items():
            if torch.is_tensor(v) and v.dim() == 0 or not torch.is_tensor(v):
                s[key] = float(v)
            elif v.shape == t.shape:
                s[key] = to_native(v.detach().float().contiguous())
            else:
                raise ConfigError(
                    f"optimizer state {key!r} has shape {tuple(v.shape)} for a "
                    f"parameter slice of shape {tuple(t.shape)}: the optimizer is "
                    "not elementwise and cannot be sharded"
                )
        piece = shard_memory.pieces[k]
        if shard_memory.master[piece.bucket] is not shard_memory.owned_params(piece.bucket):
            s[MASTER] = shard_memory.master_piece(piece)
        out[k] = s
    return out


def full_to_torch(
    full: Dict[int, Dict[str, Any]], global_ids: List[int], param_groups: List[dict], order: List[Any]
) -> dict:
    """The consolidated core state as an unsharded torch optimizer's state_dict."""
    state: Dict[int, dict] = {}
    master: Dict[int, Any] = {}
    for gid, i in enumerate(global_ids):
        if i not in full:
            continue
        shape = order[i].shape
        entry = {}
        for key, v in full[i].items():
            t = (
                torch.tensor(v, dtype=torch.float32)
                if np.isscalar(v)
                else from_native(v).reshape(shape).clone()
            )
            if key == MASTER:
                master[gid] = t
            else:
                entry[key] = t
        state[gid] = entry
    groups, at = [], 0
    for g in param_groups:
        n = len(g["params"])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(at, at + n))})
        at += n
    out = {"state": state, "param_groups": groups}
    if master:
        out["fp32_master"] = master
    return out


def torch_to_full(
    sd: Any, param_groups: List[dict], global_ids: List[int], order: List[Any], names: List[str]
) -> tuple:
    """(core full state keyed by layout index, the saved groups), after checking that `sd`
    fits this optimizer: `ConfigError` naming what does not."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ConfigError(
            "load_state_dict: expected a torch optimizer state dict with 'state' "
            "and 'param_groups' (consolidate_state_dict + state_dict on one rank)"
        )
    groups = sd["param_groups"]
    if len(groups) != len(param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(groups, param_groups)
    ):
        raise ConfigError(
            "load_state_dict: the checkpoint has param groups of sizes "
            f"{[len(g['params']) for g in groups]}, this optimizer "
            f"{[len(g['params']) for g in param_groups]}: it is from another model"
        )
    saved_ids = [i for g in groups for i in g["params"]]
    masters = sd.get("fp32_master", {})
    full: Dict[int, Dict[str, Any]] = {}
    for pos, sid in enumerate(saved_ids):
        entry = sd["state"].get(sid)
        if entry is None:
            continue
        i = global_ids[pos]
        p = order[i]
        conv: Dict[str, Any] = {}
        items = list(entry.items()) + ([(MASTER, masters[sid])] if sid in masters else [])
        for key, v in items:
            if not torch.is_tensor(v) or v.dim() == 0:
                conv[key] = float(v)
                continue
            if v.numel() != p.numel():
                raise ConfigError(
                    f"load_state_dict: state {key!r} of parameter {names[i]} has shape "
                    f"{tuple(v.shape)}, the parameter {tuple(p.shape)}: the checkpoint is from "
                    "another model"
                )
            conv[key] = to_native(v.detach().to(torch.float32).reshape(-1).contiguous())
        full[i] = conv
    return full, groups


def set_local_state(
    inner: Any, piece_params: List[Any], pieces: Dict[int, Dict[str, Any]], shard_memory: Any
) -> None:
    """Replace the inner optimizer's state by the resharded piece states; the fp32 masters of
    low-precision pieces come from the checkpoint, or from the parameters when it has none."""
    inner.state.clear()
    for k, t in enumerate(piece_params):
        piece = shard_memory.pieces[k]
        low = shard_memory.master[piece.bucket] is not shard_memory.owned_params(piece.bucket)
        s = dict(pieces.get(k, {}))
        if low:
            m = s.pop(MASTER, None)
            dst = shard_memory.master_piece(piece)
            if m is None:
                src = shard_memory.owned_params(piece.bucket)[piece.shard_lo : piece.shard_lo + piece.numel]
                dst[...] = src.astype(dst.dtype)
            else:
                dst[...] = m
        else:
            s.pop(MASTER, None)
        if s:
            inner.state[t] = {
                key: (
                    torch.tensor(v, dtype=torch.float32)
                    if np.isscalar(v)
                    else from_native(
                        np.array(v, dtype=np.float32, copy=True) if isinstance(v, np.ndarray) else v.copy()
                    )
                )
                for key, v in s.items()
            }
