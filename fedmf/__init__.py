"""fedmf: correlated-noise (matrix-factorization) differential privacy for federated learning.

The engine imports no Flower: ``server/`` and ``client/`` adapt it.
"""

from .participation import FixedEpoch, MinSep, Observed
from .workloads import Workload

__version__ = "0.1.0"
__all__ = ["MinSep", "FixedEpoch", "Observed", "Workload", "__version__"]
