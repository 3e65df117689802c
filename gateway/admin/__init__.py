"""The admin API (`/admin/...`), where tenants live, the audit log and the admin page (§11)."""
