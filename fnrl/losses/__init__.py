"""Composable pure loss terms, aggregation modes and advantage estimators.

Importing the package registers every built-in term, estimator and aggregation.
"""

from fnrl.losses import (aggregation, advantages, core, correction, covariance, kl,  # noqa: F401
                         objective, policy, value)
from fnrl.losses.core import ADVANTAGES, LOSS_TERMS, POLICY_LOSSES, register  # noqa: F401
from fnrl.losses.objective import Objective, build_objective, combine  # noqa: F401
