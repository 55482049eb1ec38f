-- postgres-roles.sql — least-privilege roles for a fedmf ledger on PostgreSQL.
--
-- Run it ONCE per ledger database, as the database owner (or a superuser), AFTER fedmf has
-- created/migrated the schema (the ledger tables must exist: the grants below cover the tables
-- present at the time it runs; re-run the GRANT part after a schema migration that adds tables).
--
--   psql -v ON_ERROR_STOP=1 -d fedmf \
--        -v schema=public \
--        -v server_role=fedmf_server   -v server_password="$(cat /etc/fedmf/pg-server.pw)" \
--        -v auditor_role=fedmf_auditor -v auditor_password="$(cat /etc/fedmf/pg-auditor.pw)" \
--        -f deploy/postgres-roles.sql
--
-- (`-d` selects the database; psql sets :DBNAME from it. All variables are required.)
--
-- What it creates:
--   * :server_role  LOGIN — CONNECT on the database, USAGE on the schema, SELECT/INSERT/UPDATE/
--                   DELETE on the ledger tables (runs, rounds, participations, client_state,
--                   privacy_snapshots), SELECT only on fedmf_ledger_version, USAGE/SELECT on the
--                   id sequences. No CREATE, no TRUNCATE, no DDL: the fedmf server can write rounds
--                   into a migrated ledger but cannot change its schema. Schema migrations (a new
--                   fedmf release) are run by the owner: `python -c "from fedmf.ledger import Ledger;
--                   Ledger.open('postgresql://OWNER@HOST/fedmf').close()"`, then re-run this file's
--                   grants (or the whole file with roles that already exist removed).
--   * :auditor_role LOGIN — CONNECT, USAGE, SELECT on every ledger table, nothing else; its
--                   sessions default to read-only transactions (fedmf audit opens the ledger read-
--                   only anyway). INSERT/UPDATE/DELETE fail with "permission denied".
--   * PUBLIC loses CONNECT on the database and CREATE on the schema.
--
-- CREATE ROLE fails if a role exists (roles are cluster-wide): for a second ledger database with
-- the same roles, run only the statements after "-- grants" (e.g. `sed -n '/^-- grants/,$p'`).
-- Nothing here is specific to one fedmf run; several runs share the tables.

BEGIN;

CREATE ROLE :"server_role" LOGIN PASSWORD :'server_password' NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
CREATE ROLE :"auditor_role" LOGIN PASSWORD :'auditor_password' NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
ALTER ROLE :"auditor_role" SET default_transaction_read_only = on;

-- grants
REVOKE ALL ON DATABASE :"DBNAME" FROM PUBLIC;
GRANT CONNECT, TEMPORARY ON DATABASE :"DBNAME" TO :"server_role";
GRANT CONNECT ON DATABASE :"DBNAME" TO :"auditor_role";

REVOKE CREATE ON SCHEMA :"schema" FROM PUBLIC;
GRANT USAGE ON SCHEMA :"schema" TO :"server_role", :"auditor_role";

REVOKE ALL ON ALL TABLES IN SCHEMA :"schema" FROM :"server_role", :"auditor_role";
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA :"schema" TO :"server_role";
REVOKE INSERT, UPDATE, DELETE ON TABLE :"schema".fedmf_ledger_version FROM :"server_role";
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA :"schema" TO :"server_role";

GRANT SELECT ON ALL TABLES IN SCHEMA :"schema" TO :"auditor_role";

COMMIT;
