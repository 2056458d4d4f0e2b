"""Memory and MFU dry runs on a machine without a GPU (filled by the estimation issue)."""
