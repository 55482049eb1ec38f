-- postgres-roles.sql — least-privilege roles for a fedmf ledger on PostgreSQL (schema revision 0003).
--
-- Run it as the PostgreSQL superuser (it creates roles, which needs CREATEROLE, and grants on the
-- tables the owner role created), connected to the ledger database, AFTER fedmf has created or
-- migrated the schema, with each password in a file only the operator can read (0600):
--
--   sudo -u postgres psql -X -v ON_ERROR_STOP=1 -d fedmf \
--        -v schema=public \
--        -v server_role=fedmf_server   -v server_password_file=/etc/fedmf/pg-server.pw \
--        -v auditor_role=fedmf_auditor -v auditor_password_file=/etc/fedmf/pg-auditor.pw \
--        -f deploy/postgres-roles.sql
--
-- Only the files' paths are on the command line: psql reads each password with `cat` (a backquoted
-- \set) and sends it to the server inside the statement, with statement logging off for this
-- session, so it is in no process list, shell history or server log. All variables are required.
-- It can be run again: roles that exist keep their settings and get the password from the file
-- (a password rotation), and the grants are re-applied (needed after a migration adds a table).
--
--   * :server_role  LOGIN — CONNECT, USAGE on the schema; on the history tables (runs, rounds,
--                   participations, update_norms) SELECT and INSERT only: the server can append a
--                   round, never UPDATE, DELETE or TRUNCATE history; on the mutable tables
--                   (round_state, client_state) SELECT, INSERT, UPDATE; SELECT on
--                   fedmf_ledger_version; USAGE on the runs id sequence. No DDL: migrations are
--                   run by the owner role.
--   * :auditor_role LOGIN — CONNECT, USAGE, SELECT on every ledger table, nothing else; its sessions
--                   default to read-only transactions.
--   * PUBLIC loses CONNECT on the database and CREATE on the schema.

\set server_password `cat :'server_password_file'`
\set auditor_password `cat :'auditor_password_file'`
SET log_statement = 'none';
SET log_min_duration_statement = -1;
SET log_min_error_statement = panic;
SELECT :'server_password' = '' OR :'auditor_password' = '' AS no_password \gset
\if :no_password
DO $$ BEGIN RAISE EXCEPTION 'postgres-roles.sql: a password file is missing or empty'; END $$;
\endif

BEGIN;

SELECT NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'server_role') AS create_server,
       NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'auditor_role') AS create_auditor \gset
\if :create_server
CREATE ROLE :"server_role" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
\endif
\if :create_auditor
CREATE ROLE :"auditor_role" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
\endif
ALTER ROLE :"server_role" PASSWORD :'server_password';
ALTER ROLE :"auditor_role" PASSWORD :'auditor_password';
ALTER ROLE :"auditor_role" SET default_transaction_read_only = on;

REVOKE ALL ON DATABASE :"DBNAME" FROM PUBLIC;
GRANT CONNECT, TEMPORARY ON DATABASE :"DBNAME" TO :"server_role";
GRANT CONNECT ON DATABASE :"DBNAME" TO :"auditor_role";

REVOKE CREATE ON SCHEMA :"schema" FROM PUBLIC;
GRANT USAGE ON SCHEMA :"schema" TO :"server_role", :"auditor_role";

REVOKE ALL ON ALL TABLES IN SCHEMA :"schema" FROM :"server_role", :"auditor_role";
REVOKE ALL ON ALL SEQUENCES IN SCHEMA :"schema" FROM :"server_role", :"auditor_role";
-- history: appended, never changed
GRANT SELECT, INSERT ON :"schema".runs, :"schema".rounds, :"schema".participations, :"schema".update_norms
    TO :"server_role";
-- what changes during a round
GRANT SELECT, INSERT, UPDATE ON :"schema".round_state, :"schema".client_state TO :"server_role";
GRANT SELECT ON :"schema".fedmf_ledger_version TO :"server_role";
-- lifetime budgets: the operator (the admin role) sets them; the server reads them, charges a user
-- once per run (appended) and records each round's skip count (rewritten when a round is redone)
GRANT SELECT ON :"schema".budget_settings, :"schema".user_budgets TO :"server_role";
GRANT SELECT, INSERT ON :"schema".budget_charges TO :"server_role";
GRANT SELECT, INSERT, UPDATE ON :"schema".budget_skips TO :"server_role";
GRANT USAGE ON SEQUENCE :"schema".runs_id_seq TO :"server_role";

GRANT SELECT ON ALL TABLES IN SCHEMA :"schema" TO :"auditor_role";

COMMIT;
