"""The one door to the Kubernetes API server: where it is and how to log in (`kubeconfig`), kept
connections (`connection`), and the REST calls the driver makes (`api`). Nothing else in the
driver opens an HTTP connection."""
