-- Runs once, when the postgres container initialises an empty data directory
-- (mounted into /docker-entrypoint-initdb.d by compose.yaml; the Kubernetes manifests carry the same
-- statement in the ConfigMap durcap-postgres-init). Temporal's auto-setup creates its own databases and
-- DBOS creates its system database at launch; Prefect needs its database to exist.
CREATE DATABASE prefect;
