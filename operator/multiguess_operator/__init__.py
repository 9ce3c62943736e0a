"""Kubernetes operator for multiguess: SpeculativeDeployment → GPU-pinned serving pods.

Importing the package registers the kopf handlers, so ``kopf run -m multiguess_operator`` works.
"""

from multiguess_operator import handlers as handlers
