//! In-memory data path for tests of the sync: same operations as the BPF maps, with
//! capacities, and a log of every write in order.

use super::{Capacity, Datapath, DatapathError, Snapshot};
use proxy_common::{Backend, BackendSlotKey, Frontend, FrontendKey, MemberKey};

/// One write, as logged by [`FakeDatapath`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    PutFrontend(FrontendKey, Frontend),
    DeleteFrontend(FrontendKey),
    PutSlot(BackendSlotKey, u32),
    DeleteSlot(BackendSlotKey),
    PutBackend(u32, Backend),
    DeleteBackend(u32),
    PutName(u32, String),
    DeleteName(u32),
    PutMember(MemberKey),
    DeleteMember(MemberKey),
    PutMaglev(u32, Vec<u32>),
    DeleteMaglev(u32),
}

/// Maps in memory. Writes beyond the capacity fail like a full BPF hash map (E2BIG).
#[derive(Debug)]
pub struct FakeDatapath {
    /// Current contents.
    pub state: Snapshot,
    /// Limits.
    pub cap: Capacity,
    /// Every successful write, in order.
    pub log: Vec<Op>,
    /// Maglev tables by service id (their ids are in `state.maglev`).
    pub tables: std::collections::BTreeMap<u32, Vec<u32>>,
}

impl FakeDatapath {
    /// Empty maps with the given limits.
    pub fn new(cap: Capacity) -> Self {
        Self {
            state: Snapshot::default(),
            cap,
            log: Vec::new(),
            tables: Default::default(),
        }
    }
}

fn full(map: &'static str) -> DatapathError {
    DatapathError::Map {
        op: "update",
        map,
        error: std::io::Error::from_raw_os_error(libc::E2BIG),
    }
}

impl Datapath for FakeDatapath {
    fn capacity(&self) -> Capacity {
        self.cap
    }
    fn snapshot(&self) -> Result<Snapshot, DatapathError> {
        Ok(self.state.clone())
    }
    fn put_frontend(&mut self, key: &FrontendKey, value: &Frontend) -> Result<(), DatapathError> {
        let m = &mut self.state.frontends;
        if !m.contains_key(key) && m.len() >= self.cap.frontends as usize {
            return Err(full("FRONTENDS"));
        }
        m.insert(*key, *value);
        self.log.push(Op::PutFrontend(*key, *value));
        Ok(())
    }
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), DatapathError> {
        self.state.frontends.remove(key);
        self.log.push(Op::DeleteFrontend(*key));
        Ok(())
    }
    fn put_slot(&mut self, key: &BackendSlotKey, backend_id: u32) -> Result<(), DatapathError> {
        let m = &mut self.state.slots;
        if !m.contains_key(key) && m.len() >= self.cap.slots as usize {
            return Err(full("BACKEND_SLOTS"));
        }
        m.insert(*key, backend_id);
        self.log.push(Op::PutSlot(*key, backend_id));
        Ok(())
    }
    fn delete_slot(&mut self, key: &BackendSlotKey) -> Result<(), DatapathError> {
        self.state.slots.remove(key);
        self.log.push(Op::DeleteSlot(*key));
        Ok(())
    }
    fn put_backend(&mut self, id: u32, value: &Backend) -> Result<(), DatapathError> {
        let m = &mut self.state.backends;
        if !m.contains_key(&id) && m.len() >= self.cap.backends as usize {
            return Err(full("BACKENDS"));
        }
        m.insert(id, *value);
        self.log.push(Op::PutBackend(id, *value));
        Ok(())
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), DatapathError> {
        self.state.backends.remove(&id);
        self.log.push(Op::DeleteBackend(id));
        Ok(())
    }
    fn put_name(&mut self, service_id: u32, name: &str) -> Result<(), DatapathError> {
        let m = &mut self.state.names;
        if !m.contains_key(&service_id) && m.len() >= self.cap.services as usize {
            return Err(full("SERVICE_NAMES"));
        }
        m.insert(service_id, name.to_string());
        self.log.push(Op::PutName(service_id, name.to_string()));
        Ok(())
    }
    fn delete_name(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.state.names.remove(&service_id);
        self.log.push(Op::DeleteName(service_id));
        Ok(())
    }
    fn put_member(&mut self, key: &MemberKey) -> Result<(), DatapathError> {
        let m = &mut self.state.members;
        if !m.contains(key) && m.len() >= self.cap.slots as usize {
            return Err(full("MEMBERS"));
        }
        m.insert(*key);
        self.log.push(Op::PutMember(*key));
        Ok(())
    }
    fn delete_member(&mut self, key: &MemberKey) -> Result<(), DatapathError> {
        self.state.members.remove(key);
        self.log.push(Op::DeleteMember(*key));
        Ok(())
    }
    fn get_maglev(&self, service_id: u32) -> Result<Option<Vec<u32>>, DatapathError> {
        Ok(self.tables.get(&service_id).cloned())
    }
    fn put_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<(), DatapathError> {
        self.tables.insert(service_id, table.to_vec());
        self.state.maglev.insert(service_id);
        self.log.push(Op::PutMaglev(service_id, table.to_vec()));
        Ok(())
    }
    fn delete_maglev(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.tables.remove(&service_id);
        self.state.maglev.remove(&service_id);
        self.log.push(Op::DeleteMaglev(service_id));
        Ok(())
    }
}
