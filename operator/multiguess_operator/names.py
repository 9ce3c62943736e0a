"""Names shared by the CRD, the children and the API calls (see crds/speculativedeployment.yaml)."""

GROUP = "multiguess.io"
VERSION = "v1alpha1"
PLURAL = "speculativedeployments"
KIND = "SpeculativeDeployment"
MANAGER = "multiguess-operator"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
