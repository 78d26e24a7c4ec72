//! Moving CRIU image directories to and from the store, streamed in bounded pieces and
//! verified by BLAKE3 on the way back.

use std::path::Path;

use futures::StreamExt;
use object_store::WriteMultipart;
use object_store::path::Path as ObjPath;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{ImageFile, Manifest, Store, StoreError};

/// Files at most this large are uploaded with one request; larger ones in parts.
const SINGLE_PUT_MAX: u64 = 8 << 20;
/// Part size and read size for large files.
const PART: usize = 8 << 20;
/// Parts in flight per file.
const PARTS_IN_FLIGHT: usize = 4;

/// A progress callback: `(bytes done, bytes in total)`.
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Send + Sync);

fn local_err(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Local { path: path.display().to_string(), source }
}

impl Store {
    fn image_key(&self, id: &str, name: &str) -> ObjPath {
        self.key(&format!("checkpoints/{id}/{name}"))
    }

    /// Uploads every regular file of `dir` except those in `skip`, as data of checkpoint `id`.
    pub async fn upload_images(
        &self,
        id: &str,
        dir: &Path,
        skip: &[&str],
        progress: Progress<'_>,
    ) -> Result<Vec<ImageFile>, StoreError> {
        let mut files = Vec::new();
        let mut entries = tokio::fs::read_dir(dir).await.map_err(local_err(dir))?;
        while let Some(entry) = entries.next_entry().await.map_err(local_err(dir))? {
            let meta = entry.metadata().await.map_err(local_err(&entry.path()))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if meta.is_file() && !skip.contains(&name.as_str()) {
                files.push((name, meta.len()));
            }
        }
        files.sort();
        let total: u64 = files.iter().map(|(_, len)| len).sum();
        let mut done = 0;
        let mut out = Vec::with_capacity(files.len());
        for (name, _) in files {
            let key = self.image_key(id, &name);
            let (size, hash) = self
                .upload_file(&dir.join(&name), &key, &mut |n| {
                    done += n;
                    progress(done, total);
                })
                .await?;
            out.push(ImageFile { name, size, blake3: hash.to_vec(), object: key.to_string() });
        }
        Ok(out)
    }

    async fn upload_file(
        &self,
        path: &Path,
        key: &ObjPath,
        advance: &mut (dyn FnMut(u64) + Send),
    ) -> Result<(u64, [u8; 32]), StoreError> {
        let mut file = tokio::fs::File::open(path).await.map_err(local_err(path))?;
        let len = file.metadata().await.map_err(local_err(path))?.len();
        let mut hasher = blake3::Hasher::new();
        if len <= SINGLE_PUT_MAX {
            let mut buf = Vec::with_capacity(len as usize);
            file.read_to_end(&mut buf).await.map_err(local_err(path))?;
            hasher.update(&buf);
            let size = buf.len() as u64;
            self.backend.put(key, buf.into()).await.map_err(Self::backend_err(key))?;
            advance(size);
            return Ok((size, *hasher.finalize().as_bytes()));
        }
        let upload = self.backend.put_multipart(key).await.map_err(Self::backend_err(key))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART);
        let mut buf = vec![0u8; PART];
        let mut size = 0u64;
        loop {
            let n = match file.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) => {
                    let _ = writer.abort().await;
                    return Err(local_err(path)(e));
                }
            };
            hasher.update(&buf[..n]);
            if let Err(e) = writer.wait_for_capacity(PARTS_IN_FLIGHT).await {
                return Err(Self::backend_err(key)(e));
            }
            writer.write(&buf[..n]);
            size += n as u64;
            advance(n as u64);
        }
        writer.finish().await.map_err(Self::backend_err(key))?;
        Ok((size, *hasher.finalize().as_bytes()))
    }

    /// Downloads the image files of `manifest` into `dir`, checking each file's size and
    /// BLAKE3 against the manifest. Returns the bytes fetched.
    pub async fn download_images(
        &self,
        manifest: &Manifest,
        dir: &Path,
        progress: Progress<'_>,
    ) -> Result<u64, StoreError> {
        let total: u64 = manifest.files.iter().map(|f| f.size).sum();
        let mut done = 0u64;
        for file in &manifest.files {
            let corrupt = |reason: String| StoreError::Corrupt {
                id: manifest.id.clone(),
                file: file.name.clone(),
                reason,
            };
            if file.name.contains('/') || file.name.starts_with('.') {
                return Err(corrupt("the manifest names an unsafe file path".into()));
            }
            let key = ObjPath::from(file.object.as_str());
            let path = dir.join(&file.name);
            let result = match self.backend.get(&key).await {
                Ok(r) => r,
                Err(object_store::Error::NotFound { .. }) => {
                    return Err(corrupt("its object is missing from the store".into()));
                }
                Err(source) => {
                    return Err(StoreError::Backend { key: key.to_string(), source });
                }
            };
            let mut out = tokio::fs::File::create(&path).await.map_err(local_err(&path))?;
            let mut hasher = blake3::Hasher::new();
            let mut size = 0u64;
            let mut stream = result.into_stream();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(Self::backend_err(&key))?;
                size += chunk.len() as u64;
                if size > file.size {
                    return Err(corrupt(format!("object is larger than the {} bytes recorded", file.size)));
                }
                hasher.update(&chunk);
                out.write_all(&chunk).await.map_err(local_err(&path))?;
                progress(done + size, total);
            }
            out.flush().await.map_err(local_err(&path))?;
            if size != file.size {
                return Err(corrupt(format!("{size} bytes stored, {} recorded (truncated)", file.size)));
            }
            if hasher.finalize().as_bytes().as_slice() != file.blake3.as_slice() {
                return Err(corrupt("content does not match its checksum".into()));
            }
            done += size;
        }
        Ok(done)
    }
}
