"""The one check of every file and directory a user names (every command's path options, the disk tier's directory),
and the argparse types of every numeric option."""

from kvprefix.paths.checks import (
    PathError,
    ReadableDir,
    ReadableFile,
    ReadablePath,
    WritableDir,
    WritableFile,
    check_readable_dir,
    check_readable_file,
    check_readable_path,
    check_writable_dir,
    check_writable_file,
)
from kvprefix.paths.numbers import fraction, positive_float, positive_int

__all__ = ["PathError", "ReadableDir", "ReadableFile", "ReadablePath", "WritableDir", "WritableFile",
           "check_readable_dir", "check_readable_file", "check_readable_path", "check_writable_dir",
           "check_writable_file", "fraction", "positive_float", "positive_int"]
