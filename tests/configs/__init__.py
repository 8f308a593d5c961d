"""Sample configuration files and small builders for the configuration tests."""
