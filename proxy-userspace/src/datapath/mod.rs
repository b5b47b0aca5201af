//! The data path as the control plane sees it: three service maps and a name map, behind a
//! trait so the sync can be tested without BPF ([`fake::FakeDatapath`]) and run for real on
//! pinned BPF maps ([`maps::PinnedMaps`]).

pub mod addr;
pub mod fake;
pub mod loader;
pub mod maps;
pub mod tc;

use std::collections::{BTreeMap, BTreeSet};

use proxy_common::{Backend, BackendSlotKey, Frontend, FrontendKey, MemberKey, ServiceName};

/// Error of a data path operation.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The desired state does not fit: `needed` entries of `map`, whose limit is `limit`.
    /// Nothing was written.
    #[error("map {map} is full: {needed} entries needed, limit {limit} (raise --{flag})")]
    Full {
        map: &'static str,
        needed: usize,
        limit: u32,
        flag: &'static str,
    },
    /// A map operation failed.
    #[error("{op} on map {map}: {error}")]
    Map {
        op: &'static str,
        map: &'static str,
        error: std::io::Error,
    },
}

/// `max_entries` of each service map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Of `FRONTENDS` (frontends plus one VIP marker per VIP).
    pub frontends: u32,
    /// Of `BACKEND_SLOTS`.
    pub slots: u32,
    /// Of `BACKENDS`.
    pub backends: u32,
    /// Of `SERVICE_NAMES` (one per service id).
    pub services: u32,
}

/// Full contents of the service maps, as read back from the kernel.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// `FRONTENDS`.
    pub frontends: BTreeMap<FrontendKey, Frontend>,
    /// `BACKEND_SLOTS`.
    pub slots: BTreeMap<BackendSlotKey, u32>,
    /// `BACKENDS`.
    pub backends: BTreeMap<u32, Backend>,
    /// `SERVICE_NAMES`, decoded.
    pub names: BTreeMap<u32, String>,
    /// `MEMBERS` keys.
    pub members: BTreeSet<MemberKey>,
    /// Service ids with a `MAGLEV` table (the tables themselves are read on demand).
    pub maglev: BTreeSet<u32>,
}

/// Writes to the service maps. Every method is one map operation; ordering is the caller's.
pub trait Datapath {
    /// Limits of the maps.
    fn capacity(&self) -> Capacity;
    /// Reads every service map.
    fn snapshot(&self) -> Result<Snapshot, DatapathError>;
    /// Creates or replaces a frontend.
    fn put_frontend(&mut self, key: &FrontendKey, value: &Frontend) -> Result<(), DatapathError>;
    /// Removes a frontend (absent is not an error).
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), DatapathError>;
    /// Creates or replaces a slot.
    fn put_slot(&mut self, key: &BackendSlotKey, backend_id: u32) -> Result<(), DatapathError>;
    /// Removes a slot (absent is not an error).
    fn delete_slot(&mut self, key: &BackendSlotKey) -> Result<(), DatapathError>;
    /// Creates or replaces a backend.
    fn put_backend(&mut self, id: u32, value: &Backend) -> Result<(), DatapathError>;
    /// Removes a backend (absent is not an error).
    fn delete_backend(&mut self, id: u32) -> Result<(), DatapathError>;
    /// Creates or replaces a service name.
    fn put_name(&mut self, service_id: u32, name: &str) -> Result<(), DatapathError>;
    /// Removes a service name (absent is not an error).
    fn delete_name(&mut self, service_id: u32) -> Result<(), DatapathError>;
    /// Marks a backend as a member of a service id's set.
    fn put_member(&mut self, key: &MemberKey) -> Result<(), DatapathError>;
    /// Removes a membership (absent is not an error).
    fn delete_member(&mut self, key: &MemberKey) -> Result<(), DatapathError>;
    /// The Maglev table of a service id, if any (its `size` entries).
    fn get_maglev(&self, service_id: u32) -> Result<Option<Vec<u32>>, DatapathError>;
    /// Creates or replaces the Maglev table of a service id (`table.len()` is its size, a
    /// prime `<= MAGLEV_MAX`).
    fn put_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<(), DatapathError>;
    /// Removes a Maglev table (absent is not an error).
    fn delete_maglev(&mut self, service_id: u32) -> Result<(), DatapathError>;
}

/// Encodes a service name for `SERVICE_NAMES`, truncated to the map's value size.
pub fn encode_name(name: &str) -> ServiceName {
    let mut v = ServiceName::default();
    let bytes = name.as_bytes();
    let n = bytes.len().min(v.name.len());
    v.name[..n].copy_from_slice(&bytes[..n]);
    v.len = n as u32;
    v
}

/// Decodes a `SERVICE_NAMES` value (lossy on invalid UTF-8).
pub fn decode_name(v: &ServiceName) -> String {
    let n = (v.len as usize).min(v.name.len());
    String::from_utf8_lossy(&v.name[..n]).into_owned()
}
