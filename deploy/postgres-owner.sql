-- postgres-owner.sql — the ledger database and its owner role (who creates and migrates the schema).
--
-- Run it as the PostgreSQL superuser, connected to any database, BEFORE `fedmf ledger migrate`, with
-- the owner's password on psql's standard input (so the password file stays the operator's, 0600):
--
--   sudo cat /etc/fedmf/pg/owner.pw | sudo -u postgres psql -X -v ON_ERROR_STOP=1 \
--        -v owner_role=fedmf_owner -v database=fedmf -f deploy/postgres-owner.sql
--
-- The password is read from standard input with `cat` (a backquoted \set) and sent inside the
-- statement with statement logging off for this session: it is on no command line, in no process
-- list and in no server log.
-- It can be run again: an existing role keeps its settings and takes the new password (a rotation);
-- an existing database is kept. An empty password stops it before anything is created.
--
--   * :owner_role  LOGIN, no superuser, CREATEDB or CREATEROLE — owns :database and its tables.

\set owner_password `cat`
SET log_statement = 'none';
SET log_min_duration_statement = -1;
SET log_min_error_statement = panic;
SELECT :'owner_password' = '' AS no_password \gset
\if :no_password
DO $$ BEGIN RAISE EXCEPTION 'postgres-owner.sql: the owner password is missing or empty'; END $$;
\endif

SELECT NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'owner_role') AS create_owner \gset
\if :create_owner
CREATE ROLE :"owner_role" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE;
\endif
ALTER ROLE :"owner_role" PASSWORD :'owner_password';

SELECT NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'database') AS create_database \gset
\if :create_database
CREATE DATABASE :"database" OWNER :"owner_role";
\endif
