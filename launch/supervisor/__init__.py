"""The supervisor: an arbiter that keeps the processes at their desired counts, and the named parts beside it
(``server`` says which and how they are wired)."""

from ..tiers import ModelTier, ServeConfig
from .arbiter import ABORT_GRACE, Arbiter, TierFailed
from .server import EXIT_SUPERVISOR_FAILED, StartupError, Supervisor

__all__ = ["ABORT_GRACE", "EXIT_SUPERVISOR_FAILED", "Arbiter", "ModelTier", "ServeConfig", "StartupError",
           "Supervisor", "TierFailed"]
