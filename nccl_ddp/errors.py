"""Every error nccl_ddp raises on purpose; catch `NcclDdpError` for all of them.

Messages name the rank, the parameter / bucket / op involved and what to do about it.
"""

from __future__ import annotations


class NcclDdpError(RuntimeError):
    """Base class of the errors this package raises on purpose."""


class ConfigError(NcclDdpError, ValueError):
    """Inconsistent or missing configuration: environment variables, arguments, launcher flags."""


class ConfigTypeError(NcclDdpError, TypeError):
    """An argument of the wrong type (the `TypeError` twin of `ConfigError`)."""


class StoreError(NcclDdpError):
    """The key-value store failed: connection refused or lost, protocol error."""


class StoreTimeout(StoreError, TimeoutError):
    """A store get/wait/barrier/connect did not complete within its timeout."""


class AuthError(StoreError):
    """The store refused a client that did not present the job's secret."""


class CommError(NcclDdpError):
    """A collective failed (transport error, NCCL async error, a peer died)."""


class CommTimeout(CommError, TimeoutError):
    """A collective, stream or event wait did not complete within its timeout."""


class RankMismatchError(NcclDdpError):
    """Ranks disagree on something that must match (parameter shapes, bucket layout, op order)."""


class ReducerError(NcclDdpError):
    """Misuse of the reducer during a step: grads missing, a grad marked ready twice, ..."""


class CommHookError(ReducerError):
    """A registered comm hook failed a step: it returned something other than the reduced bucket
    (a wrong type, shape or dtype). The step is broken; later steps say so, naming this error."""


class KernelError(NcclDdpError):
    """A CUDA kernel could not be found, compiled or launched."""


class JoinError(NcclDdpError):
    """Inside `Join`: a rank raised (the others name it instead of hanging), or a rank ran out of
    inputs with `throw_on_early_termination=True`."""


class NonFiniteGradError(NcclDdpError):
    """`check_finite="raise"`: a step's grads held NaN or Inf (raised on every rank)."""


class FrameworkVersionError(NcclDdpError, ImportError):
    """A glue library (Lightning, Accelerate) lacks a private name our glue relies on: a version
    newer than the one we test. The message names the name and the tested version."""


class ShardedGradError(NcclDdpError):
    """Under ZeRO-2 a `p.grad` holds this rank's local grad (the averaged one exists only as each
    rank's shard), and code read it as the averaged grad (e.g. torch's `clip_grad_norm_`)."""
