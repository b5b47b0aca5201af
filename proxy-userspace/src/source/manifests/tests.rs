use super::*;
use crate::source::ObjectSet;
use crate::source::manifests::fixtures::{SVC, write};

/// What a consumer of the source knows: every batch folded into an object set.
struct Follower {
    rx: mpsc::Receiver<Batch>,
    objects: ObjectSet,
    errors: Vec<SourceError>,
    /// A complete batch came.
    synced: bool,
}

impl Follower {
    fn new(rx: mpsc::Receiver<Batch>) -> Self {
        Follower {
            rx,
            objects: ObjectSet::default(),
            errors: Vec::new(),
            synced: false,
        }
    }

    /// Folds the next batch; returns its number of changes.
    async fn next(&mut self) -> usize {
        let b = tokio::time::timeout(Duration::from_secs(5), self.rx.recv())
            .await
            .expect("no batch within 5 s")
            .expect("source stopped");
        assert!(
            b.synced || !self.synced,
            "every batch after the first complete one is complete"
        );
        self.synced |= b.synced;
        let n = b.changes.len();
        for c in b.changes {
            self.objects.apply(c);
        }
        if let Some(e) = b.errors {
            self.errors = e;
        }
        n
    }

    /// Folds batches until the Services are `want` (or 5 s pass).
    async fn until_services(&mut self, want: &[&str]) {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while self.service_names() != want {
            assert!(
                std::time::Instant::now() < deadline,
                "services {:?}, want {want:?}",
                self.service_names()
            );
            self.next().await;
        }
    }

    fn service_names(&self) -> Vec<String> {
        self.objects
            .services
            .keys()
            .map(|(_, n)| n.clone())
            .collect()
    }
}

#[tokio::test]
async fn manifest_source_follows_the_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().to_path_buf();
    write(&d, "a.yaml", SVC);
    let mut f = Follower::new(ManifestSource::new(&d).start().unwrap());

    // Initial batch.
    f.next().await;
    assert_eq!(f.service_names(), vec!["web"]);
    assert!(f.errors.is_empty());

    // A new file.
    write(
        &d,
        "b.yaml",
        &SVC.replace("name: web", "name: api")
            .replace("10.96.0.10", "10.96.0.20"),
    );
    f.until_services(&["api", "web"]).await;

    // Replaced by rename (as sed -i and editors do): read at once, without a debounce.
    write(
        &d,
        ".b.yaml.tmp",
        &SVC.replace("name: web", "name: api2")
            .replace("10.96.0.10", "10.96.0.21"),
    );
    std::fs::rename(d.join(".b.yaml.tmp"), d.join("b.yaml")).unwrap();
    f.until_services(&["api2", "web"]).await;

    // A removed file.
    std::fs::remove_file(d.join("a.yaml")).unwrap();
    f.until_services(&["api2"]).await;

    // Temporarily empty, then filled again.
    std::fs::remove_file(d.join("b.yaml")).unwrap();
    f.until_services(&[]).await;
    assert!(f.objects.is_empty());
    write(&d, "c.yaml", SVC);
    f.until_services(&["web"]).await;

    // A broken file is reported, the rest stays.
    write(&d, "d.yaml", "kind: [");
    while f.errors.is_empty() {
        f.next().await;
    }
    assert_eq!(f.service_names(), vec!["web"]);
    assert_eq!(f.errors.len(), 1);
}

#[tokio::test]
async fn a_change_to_one_file_reads_only_that_file_and_gives_only_its_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().to_path_buf();
    for i in 0..20 {
        write(
            &d,
            &format!("s{i:02}.yaml"),
            &SVC.replace("name: web", &format!("name: web{i}")),
        );
    }
    let mut f = Follower::new(ManifestSource::new(&d).start().unwrap());
    assert_eq!(f.next().await, 20);
    // Rename one file into place: one batch with that file's object only.
    write(
        &d,
        ".tmp",
        &SVC.replace("name: web", "name: web7")
            .replace("10.96.0.10", "10.96.0.99"),
    );
    std::fs::rename(d.join(".tmp"), d.join("s07.yaml")).unwrap();
    assert_eq!(f.next().await, 1);
    let s = &f.objects.services[&("shop".to_string(), "web7".to_string())];
    assert_eq!(
        s.object.spec.as_ref().unwrap().cluster_ip.as_deref(),
        Some("10.96.0.99")
    );
}

#[tokio::test]
async fn duplicates_across_files_follow_the_last_file_and_fall_back_when_it_drops_one() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().to_path_buf();
    write(&d, "1.yaml", SVC);
    write(&d, "2.yaml", &SVC.replace("10.96.0.10", "10.96.0.11"));
    let mut f = Follower::new(ManifestSource::new(&d).start().unwrap());
    f.next().await;
    let ip = |f: &Follower| {
        f.objects.services[&("shop".to_string(), "web".to_string())]
            .object
            .spec
            .as_ref()
            .unwrap()
            .cluster_ip
            .clone()
    };
    assert_eq!(ip(&f).as_deref(), Some("10.96.0.11"));
    assert_eq!(f.errors.len(), 1, "{:?}", f.errors);
    // The winner drops it: the other file's definition is in force again.
    std::fs::remove_file(d.join("2.yaml")).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while ip(&f).as_deref() != Some("10.96.0.10") {
        assert!(std::time::Instant::now() < deadline);
        f.next().await;
    }
    assert!(f.errors.is_empty(), "{:?}", f.errors);
    // The last one goes too: the Service is deleted.
    std::fs::remove_file(d.join("1.yaml")).unwrap();
    f.until_services(&[]).await;
}

#[tokio::test]
async fn manifest_source_survives_directory_recreation() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("m");
    std::fs::create_dir(&d).unwrap();
    write(&d, "a.yaml", SVC);
    let mut f = Follower::new(
        ManifestSource::new(&d)
            .with_resync(Duration::from_millis(200))
            .start()
            .unwrap(),
    );
    f.next().await;
    assert_eq!(f.service_names(), vec!["web"]);

    // The directory goes away: what was read stays (no deletion is sent).
    std::fs::remove_dir_all(&d).unwrap();
    let quiet = tokio::time::timeout(Duration::from_millis(500), async {
        loop {
            f.next().await;
            if f.service_names() != vec!["web"] {
                return;
            }
        }
    })
    .await;
    assert!(
        quiet.is_err(),
        "the Services changed: {:?}",
        f.service_names()
    );

    // It comes back with other content: picked up (by the resync) and watched again.
    std::fs::create_dir(&d).unwrap();
    write(&d, "b.yaml", &SVC.replace("name: web", "name: api"));
    f.until_services(&["api"]).await;
    write(
        &d,
        "c.yaml",
        &SVC.replace("name: web", "name: third")
            .replace("10.96.0.10", "10.96.0.30"),
    );
    f.until_services(&["api", "third"]).await;
}

#[tokio::test]
async fn the_first_listing_comes_in_chunks_and_only_the_last_batch_is_complete() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().to_path_buf();
    for i in 0..5 {
        write(
            &d,
            &format!("s{i}.yaml"),
            &SVC.replace("name: web", &format!("name: web{i}")),
        );
    }
    // One file per chunk.
    let mut rx = ManifestSource::new(&d).with_chunk_bytes(1).start().unwrap();
    let mut seen = Vec::new();
    loop {
        let b = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        seen.push((b.changes.len(), b.synced, b.errors.is_some()));
        if b.synced {
            break;
        }
    }
    // Five batches of one object; only the last is complete and carries the errors.
    assert_eq!(
        seen,
        vec![
            (1, false, false),
            (1, false, false),
            (1, false, false),
            (1, false, false),
            (1, true, true)
        ]
    );
    // Later changes come whole, as before.
    let mut f = Follower::new(rx);
    f.synced = true;
    write(&d, ".tmp", &SVC.replace("name: web", "name: web9"));
    std::fs::rename(d.join(".tmp"), d.join("s2.yaml")).unwrap();
    assert_eq!(f.next().await, 2, "web2 deleted, web9 applied");
}
