//! Reading a text file a user names on the command line (an `@FILE` adapter list, a `--trace`) under
//! one set of rules: only a regular file, opened without waiting, read up to a size limit. A wrong
//! path such as `/dev/zero` or a FIFO is refused at once instead of exhausting memory or hanging.

use std::io::Read as _;

/// Why [`read_regular_text`] read nothing.
#[derive(Debug)]
pub enum TextFileError {
    /// Opening or reading failed (missing, unreadable, not UTF-8).
    Io(std::io::Error),
    /// The path is a FIFO, a device, a socket or a folder.
    NotRegular,
    /// The file holds more than the limit given.
    TooLarge,
}

/// The whole text of the regular file `file`, at most `max_bytes` bytes.
///
/// Errors: [`TextFileError`] saying which rule the file broke.
pub fn read_regular_text(file: &str, max_bytes: u64) -> Result<String, TextFileError> {
    let opened = open_nonblocking(file).map_err(TextFileError::Io)?;
    if !opened.metadata().map_err(TextFileError::Io)?.is_file() {
        return Err(TextFileError::NotRegular);
    }
    let mut text = String::new();
    // Read at most one byte past the limit: the file may grow after its size was seen.
    opened.take(max_bytes + 1).read_to_string(&mut text).map_err(TextFileError::Io)?;
    if text.len() as u64 > max_bytes {
        return Err(TextFileError::TooLarge);
    }
    Ok(text)
}

/// `file` opened for reading without waiting: opening a FIFO blocks until a writer comes, so its type is
/// checked on the opened file instead (regular files ignore the flag).
fn open_nonblocking(file: &str) -> std::io::Result<std::fs::File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, libc::O_NONBLOCK);
    options.open(file)
}
