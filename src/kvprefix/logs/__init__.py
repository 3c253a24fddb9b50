"""The request-log record (one versioned schema), its writer and its reader; JSONL rows and errors that name the
line, for every log reader (no torch)."""

from kvprefix.logs.request_log import FORMAT_VERSION, RequestLogWriter, RequestRecord, iter_records
from kvprefix.logs.rows import BODIES, MOONCAKE, REQUEST_LOG, LogError, detect_format, iter_rows

__all__ = ["BODIES", "FORMAT_VERSION", "MOONCAKE", "REQUEST_LOG", "LogError", "RequestLogWriter", "RequestRecord",
           "detect_format", "iter_records", "iter_rows"]
