"""What webhooks exist: loading, defaulting and validating configuration into an immutable Snapshot."""
