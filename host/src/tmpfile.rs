//! An output file written under a temporary name (`<name>.tmp`): renamed to its real name only
//! when complete, and removed if dropped before that (an error, a full disk, a panic), so no
//! incomplete file is ever left under a real name and a failed run leaves no partial file at
//! all. Only a kill -9 can leave the `.tmp`; the next run overwrites it.

use std::fs::File;
use std::path::{Path, PathBuf};

/// The temporary file of `path`, open for writing.
#[derive(Debug)]
pub struct TmpFile {
    tmp: PathBuf,
    path: PathBuf,
    committed: bool,
}

impl TmpFile {
    /// Create (truncate) `path` + `.tmp` for writing.
    pub fn create(path: &Path) -> std::io::Result<(Self, File)> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let file = File::create(&tmp)?;
        Ok((TmpFile { tmp, path: path.to_path_buf(), committed: false }, file))
    }

    /// Sync `file` (this guard's) to disk, then move it to the real name.
    pub fn commit(mut self, file: File) -> std::io::Result<()> {
        file.sync_all()?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path)?;
        self.committed = true;
        Ok(())
    }

    /// Write `bytes` as the whole of `path`, through a temporary file.
    pub fn write(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        use std::io::Write;
        let (guard, mut file) = Self::create(path)?;
        file.write_all(bytes)?;
        guard.commit(file)
    }
}

impl Drop for TmpFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_leaves_nothing_committed_leaves_the_real_name() {
        let dir = std::env::temp_dir().join(format!("kt-tmpfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.json");
        let (guard, _file) = TmpFile::create(&path).unwrap();
        assert!(dir.join("a.json.tmp").exists());
        drop(guard);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        TmpFile::write(&path, b"{}").unwrap();
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["a.json"]);
        assert_eq!(std::fs::read(&path).unwrap(), b"{}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
