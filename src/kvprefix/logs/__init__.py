"""The request-log record: one versioned schema, its writer and its reader (no torch)."""

from kvprefix.logs.request_log import (
    FORMAT_VERSION,
    RequestLogError,
    RequestLogWriter,
    RequestRecord,
    iter_records,
)

__all__ = ["FORMAT_VERSION", "RequestLogError", "RequestLogWriter", "RequestRecord", "iter_records"]
