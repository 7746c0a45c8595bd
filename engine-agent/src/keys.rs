//! The agent's Ed25519 signing key file (architecture.md section 4, "Keys").
//!
//! `keygen` writes a PKCS#8 v2 document (ring `Ed25519KeyPair::generate_pkcs8`) with mode
//! 0600, created exclusively; loading refuses a file that group or others can read or write.

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use narwhal_shared::{PublicKey, SigningKey};

/// Errors with the key file; each names the config key `signing_key` and the path.
#[derive(Debug, thiserror::Error)]
pub enum KeyFileError {
    /// The file cannot be read or written.
    #[error("signing_key {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// I/O error.
        source: std::io::Error,
    },
    /// Group or others have access to the key.
    #[error(
        "signing_key {path}: mode {mode:04o} lets group or others access the key; \
         run `chmod 600 {path}`"
    )]
    Permissions {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// The file is not an Ed25519 PKCS#8 key.
    #[error("signing_key {path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
}

/// Generates a key into `out` (mode 0600; refuses to overwrite unless `force`) and returns
/// its public key.
///
/// # Errors
/// [`KeyFileError::Io`] (including "file exists") or [`KeyFileError::Invalid`] when the random
/// source fails.
pub fn keygen(out: &Path, force: bool) -> Result<PublicKey, KeyFileError> {
    let io = |source| KeyFileError::Io {
        path: out.to_path_buf(),
        source,
    };
    let pkcs8 = SigningKey::generate_pkcs8().map_err(|e| KeyFileError::Invalid {
        path: out.to_path_buf(),
        reason: e.to_string(),
    })?;
    let key = SigningKey::from_pkcs8(&pkcs8).map_err(|e| KeyFileError::Invalid {
        path: out.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).mode(0o600);
    if force {
        opts.create(true).truncate(true);
    } else {
        opts.create_new(true);
    }
    let mut f = opts.open(out).map_err(io)?;
    // A pre-existing file overwritten with --force keeps its old mode: tighten it.
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .map_err(io)?;
    f.write_all(&pkcs8).map_err(io)?;
    f.sync_all().map_err(io)?;
    Ok(key.public_key())
}

/// Loads the key, refusing one readable or writable by group or others.
///
/// # Errors
/// [`KeyFileError::Io`], [`KeyFileError::Permissions`] or [`KeyFileError::Invalid`].
pub fn load(path: &Path) -> Result<SigningKey, KeyFileError> {
    let io = |source| KeyFileError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(KeyFileError::Permissions {
            path: path.to_path_buf(),
            mode,
        });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    SigningKey::from_pkcs8(&bytes).map_err(|e| KeyFileError::Invalid {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keygen_writes_0600_and_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k.pk8");
        let pk = keygen(&p, false).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(load(&p).unwrap().public_key(), pk);
        assert!(matches!(keygen(&p, false), Err(KeyFileError::Io { .. })));
        let pk2 = keygen(&p, true).unwrap();
        assert_ne!(pk, pk2);
    }

    #[test]
    fn group_readable_and_garbage_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k.pk8");
        keygen(&p, false).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        let err = load(&p).unwrap_err();
        assert!(
            matches!(err, KeyFileError::Permissions { mode: 0o640, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("signing_key"));
        let junk = dir.path().join("junk");
        std::fs::write(&junk, b"not a key").unwrap();
        std::fs::set_permissions(&junk, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(load(&junk), Err(KeyFileError::Invalid { .. })));
    }
}
