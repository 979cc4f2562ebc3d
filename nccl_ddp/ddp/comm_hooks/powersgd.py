"""PowerSGD (Vogels et al., 2019) as a comm hook: torch's `PowerSGDState` / `powerSGD_hook` on
NumPy or CuPy buckets, with the array module's own matmul and QR.

Each grad matrix M (n x m, a parameter's grad viewed as shape[0] x rest) is sent as two rank-r
factors: P = M Q is all-reduced and orthogonalized, then Q = M^T P is all-reduced and averaged,
and M is replaced by P Q^T: (n + m) r numbers on the wire instead of n m. Error feedback adds
what the last approximation lost to the next step's grad; warm start reuses Q across steps. Grads
too small to be worth it (`min_compression_rate`), and every grad before `start_powerSGD_iter`,
are all-reduced as they are. Same arithmetic and order as torch's, so the results agree to
float32 rounding given the same initial Q (`random_factors`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Dict, List, Optional

import numpy as np

from nccl_ddp.comm.group import ProcessGroup
from nccl_ddp.ddp.comm_hooks.default import Future, GradBucket, all_reduce_fut, allreduce_hook
from nccl_ddp.errors import ConfigError
from nccl_ddp.validate import check_bool, check_positive_int


class PowerSGDState:
    """The options and the per-bucket memory of `powerSGD_hook` (torch's `PowerSGDState`)."""

    def __init__(
        self,
        process_group: Optional[ProcessGroup] = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
    ) -> None:
        check_positive_int("matrix_approximation_rank", matrix_approximation_rank)
        check_positive_int("start_powerSGD_iter", start_powerSGD_iter, allow_zero=True)
        check_bool("use_error_feedback", use_error_feedback)
        check_bool("warm_start", warm_start)
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ConfigError(
                "start_powerSGD_iter must be > 1 when use_error_feedback or warm_start "
                f"is on (got {start_powerSGD_iter}): PowerSGD can only start after "
                "the buckets are rebuilt, at the second step"
            )
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.rng = np.random.RandomState(random_seed)
        self.error_dict: Dict[int, Any] = {}
        self.p_memory_dict: Dict[int, Any] = {}
        self.q_memory_dict: Dict[int, Any] = {}
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple:
        """(rate, elements before compression, elements after), summed over every hook call."""
        after = self.total_numel_after_compression
        return (
            self.total_numel_before_compression / after if after else 0,
            self.total_numel_before_compression,
            after,
        )

    def random_factors(self, seed: int, shapes: List[tuple], dtype: Any) -> List[np.ndarray]:
        """The initial Qs of one bucket, standard normal (override to choose them)."""
        g = np.random.RandomState(seed)
        return [g.standard_normal(s).astype(dtype) for s in shapes]


def powerSGD_hook(state: PowerSGDState, bucket: GradBucket) -> Future:  # noqa: N802 - torch's name
    """Reduce `bucket` with rank-`matrix_approximation_rank` PowerSGD (see the module doc)."""
    group = state.process_group or bucket.process_group
    buf = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(group, bucket)
    xp = _xp(buf)
    b = bucket.index()
    buf_cp = _add_error(state, b, buf, xp)
    to_compress, uncompressed, p_size, q_size = _sort_grads(state, bucket.gradients())
    flat_unc = (
        xp.concatenate([t.reshape(-1) for t in uncompressed]) if uncompressed else xp.zeros(0, buf.dtype)
    )
    mats, ps, qs = _factors(state, b, to_compress, p_size, q_size, buf.dtype, xp)
    eps = state.orthogonalization_epsilon
    _compute_ps(mats, ps, qs, eps, xp)
    _reduce_uncompressed(group, flat_unc, uncompressed)
    _compute_qs(group, state.p_memory_dict[b], mats, ps, qs, eps, xp)
    _decompress(group, state.q_memory_dict[b], mats, ps, qs)
    if buf_cp is not None:
        state.error_dict[b] = buf_cp - buf
    if not state.warm_start:
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
    state.maybe_increase_iter(bucket)
    return Future.completed(buf)


def _add_error(state: PowerSGDState, b: int, buf: Any, xp: Any) -> Any:
    """Error feedback, first half: add what the last step's approximation lost to this grad; the
    copy returned (None without error feedback) gives this step's loss after decompression."""
    if not state.use_error_feedback:
        return None
    if b in state.error_dict:
        buf += state.error_dict[b]
    else:
        state.error_dict[b] = xp.zeros_like(buf)
    return buf.copy()


def _sort_grads(state: PowerSGDState, grads: List[Any]) -> tuple:
    """(matrices worth compressing, grads sent as they are, P's and Q's sizes), counting both
    into the state's compression statistics."""
    to_compress, uncompressed = [], []
    p_size = q_size = 0
    for t in grads:
        if t.ndim == 0:
            uncompressed.append(t)
            state.total_numel_before_compression += 1
            state.total_numel_after_compression += 1
            continue
        mat = t.reshape(t.shape[0], -1)
        n, m = mat.shape
        r = min(n, m, state.matrix_approximation_rank)
        state.total_numel_before_compression += n * m
        if (n + m) * r * state.min_compression_rate < n * m:
            to_compress.append(mat)
            p_size += n * r
            q_size += m * r
            state.total_numel_after_compression += (n + m) * r
        else:
            uncompressed.append(t)
            state.total_numel_after_compression += n * m
    return to_compress, uncompressed, p_size, q_size


def _factors(
    state: PowerSGDState, b: int, to_compress: List[Any], p_size: int, q_size: int, dtype: Any, xp: Any
) -> tuple:
    """(matrices, P views, Q views) in torch's order (grouped by shape), over the bucket's flat
    P and Q memory; new memory and random Qs on the first step, or every step without warm start."""
    randomize = not state.warm_start or b not in state.p_memory_dict
    if randomize:
        state.p_memory_dict[b] = xp.empty(p_size, dtype)
        state.q_memory_dict[b] = xp.empty(q_size, dtype)
    by_shape: Dict[tuple, list] = defaultdict(list)  # torch's order: grouped by shape
    for mat in to_compress:
        by_shape[mat.shape].append(mat)
    mats, ps, qs = [], [], []
    pi = qi = 0
    for group_mats in by_shape.values():
        for mat in group_mats:
            n, m = mat.shape
            r = min(n, m, state.matrix_approximation_rank)
            mats.append(mat)
            ps.append(state.p_memory_dict[b][pi : pi + n * r].reshape(n, r))
            qs.append(state.q_memory_dict[b][qi : qi + m * r].reshape(m, r))
            pi, qi = pi + n * r, qi + m * r
    if randomize:
        seed = state.rng.randint(1_000_000_000)
        for q, init in zip(qs, state.random_factors(seed, [q.shape for q in qs], dtype)):
            q[...] = xp.asarray(init)
    return mats, ps, qs


def _compute_ps(mats: List[Any], ps: List[Any], qs: List[Any], eps: float, xp: Any) -> None:
    """P = M Q, from the orthogonalized Qs."""
    for q in qs:
        orthogonalize(q, eps)
    for mat, q, p in zip(mats, qs, ps):
        xp.matmul(mat, q, out=p)


def _reduce_uncompressed(group: ProcessGroup, flat_unc: Any, uncompressed: List[Any]) -> None:
    """Average the grads sent as they are, in one flat all-reduce, and copy them back."""
    all_reduce_fut(group, flat_unc).wait()
    flat_unc /= group.size
    at = 0
    for t in uncompressed:
        t[...] = flat_unc[at : at + t.size].reshape(t.shape)
        at += t.size


def _compute_qs(
    group: ProcessGroup, p_memory: Any, mats: List[Any], ps: List[Any], qs: List[Any], eps: float, xp: Any
) -> None:
    """All-reduce every P (one flat buffer), orthogonalize it, then Q = M^T P."""
    all_reduce_fut(group, p_memory).wait()
    for p in ps:
        orthogonalize(p, eps)
    for mat, p, q in zip(mats, ps, qs):
        xp.matmul(mat.T, p, out=q)


def _decompress(group: ProcessGroup, q_memory: Any, mats: List[Any], ps: List[Any], qs: List[Any]) -> None:
    """Average every Q (one flat all-reduce), then each grad matrix becomes P Q^T."""
    all_reduce_fut(group, q_memory).wait()
    q_memory /= group.size
    for p, q, mat in zip(ps, qs, mats):
        mat[...] = p @ q.T


def orthogonalize(mat: Any, epsilon: float = 0) -> None:
    """Orthonormalize the columns of `mat` (n x r) in place: Gram-Schmidt for r <= 2 or half
    dtypes, else QR (torch's `_orthogonalize`)."""
    xp = _xp(mat)
    r = mat.shape[1]
    if r > 2 and mat.dtype.itemsize > 2:
        q, _ = xp.linalg.qr(mat)
        mat[...] = q
        return
    for i in range(r):
        col = mat[:, i : i + 1]
        norm = xp.sqrt(xp.sum(col * col, axis=0, keepdims=True))
        col /= norm + mat.dtype.type(epsilon) if epsilon else norm
        if i + 1 < r:
            rest = mat[:, i + 1 :]
            rest -= xp.sum(col * rest, axis=0, keepdims=True) * col


def _xp(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        return np
    import cupy  # only reached for CuPy buckets

    return cupy
