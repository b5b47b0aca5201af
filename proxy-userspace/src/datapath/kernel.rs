//! [`Datapath`](super::Datapath) for real: the pinned service maps ([`PinnedMaps`]), the tc
//! programs and maps ([`TcKernel`]), this network namespace's interfaces and routes, and the
//! health-check servers ([`HealthCheckServers`]).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use aya::maps::lpm_trie::Key;
use proxy_common::{
    Backend, BackendSlot, BackendSlotKey, Frontend, FrontendKey, MemberKey,
    nat::{DsrKey, DsrTarget, IfaceAddr},
};

use super::tc::XdpMode;
use super::{
    Capacity, DatapathError, HealthServers, Interface, Interfaces, NodeMaps, NodeSnapshot,
    Released, ServiceMaps, Snapshot, SourceRangeKey,
    maps::PinnedMaps,
    tc::{self, TcKernel},
};
use super::{HealthCheck, healthcheck::HealthCheckServers};

/// The node's data path. See the module documentation.
pub struct KernelDatapath {
    /// The service maps.
    pub maps: PinnedMaps,
    /// The tc programs and maps.
    pub tc: TcKernel,
    /// The health-check servers.
    pub health: HealthCheckServers,
}

fn tc_err(op: &'static str, map: &'static str, e: impl std::fmt::Display) -> DatapathError {
    DatapathError::Map {
        op,
        map,
        error: std::io::Error::other(e.to_string()),
    }
}

/// Deleting an absent key is no error.
fn absent_ok(r: Result<(), aya::maps::MapError>) -> Result<(), aya::maps::MapError> {
    match r {
        Err(aya::maps::MapError::KeyNotFound) | Err(aya::maps::MapError::ElementNotFound) => Ok(()),
        Err(aya::maps::MapError::SyscallError(s))
            if s.io_error.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(())
        }
        other => other,
    }
}

impl ServiceMaps for KernelDatapath {
    fn capacity(&self) -> Capacity {
        self.maps.capacity()
    }
    fn snapshot(&self) -> Result<Snapshot, DatapathError> {
        self.maps.snapshot()
    }
    fn begin_bulk(&mut self) {
        self.maps.begin_bulk()
    }
    fn end_bulk(&mut self) -> Result<(), DatapathError> {
        self.maps.end_bulk()
    }
    fn put_frontend(&mut self, key: &FrontendKey, value: &Frontend) -> Result<(), DatapathError> {
        self.maps.put_frontend(key, value)
    }
    fn delete_frontend(&mut self, key: &FrontendKey) -> Result<(), DatapathError> {
        self.maps.delete_frontend(key)
    }
    fn put_slot(&mut self, key: &BackendSlotKey, value: &BackendSlot) -> Result<(), DatapathError> {
        self.maps.put_slot(key, value)
    }
    fn delete_slot(&mut self, key: &BackendSlotKey) -> Result<(), DatapathError> {
        self.maps.delete_slot(key)
    }
    fn put_backend(&mut self, id: u32, value: &Backend) -> Result<(), DatapathError> {
        self.maps.put_backend(id, value)
    }
    fn delete_backend(&mut self, id: u32) -> Result<(), DatapathError> {
        self.maps.delete_backend(id)
    }
    fn put_name(&mut self, service_id: u32, name: &str) -> Result<(), DatapathError> {
        self.maps.put_name(service_id, name)
    }
    fn delete_name(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.maps.delete_name(service_id)
    }
    fn put_member(&mut self, key: &MemberKey, weight: u32) -> Result<(), DatapathError> {
        self.maps.put_member(key, weight)
    }
    fn delete_member(&mut self, key: &MemberKey) -> Result<(), DatapathError> {
        self.maps.delete_member(key)
    }
    fn get_maglev(&self, service_id: u32) -> Result<Option<Vec<u32>>, DatapathError> {
        self.maps.get_maglev(service_id)
    }
    fn put_maglev(&mut self, service_id: u32, table: &[u32]) -> Result<(), DatapathError> {
        self.maps.put_maglev(service_id, table)
    }
    fn delete_maglev(&mut self, service_id: u32) -> Result<(), DatapathError> {
        self.maps.delete_maglev(service_id)
    }
    fn release_stale(
        &mut self,
        released: &[(u32, u32, Backend)],
    ) -> Result<Released, DatapathError> {
        self.maps.release_stale(released)
    }
    fn sweep_stats(&mut self, bound: &super::Bound<'_>) -> Result<usize, DatapathError> {
        self.maps.sweep_stats(bound)
    }
}

impl NodeMaps for KernelDatapath {
    fn node_snapshot(&self) -> Result<NodeSnapshot, DatapathError> {
        self.tc
            .snapshot()
            .map_err(|e| tc_err("iterate", "TC maps", format!("{e:#}")))
    }
    fn put_local_endpoint(&mut self, addr: &[u8; 16]) -> Result<(), DatapathError> {
        self.tc
            .local_endpoints()
            .insert(addr, 1, 0)
            .map_err(|e| tc_err("update", "TC_LOCAL_ENDPOINTS", e))
    }
    fn delete_local_endpoint(&mut self, addr: &[u8; 16]) -> Result<(), DatapathError> {
        absent_ok(self.tc.local_endpoints().remove(addr))
            .map_err(|e| tc_err("delete", "TC_LOCAL_ENDPOINTS", e))
    }
    fn put_source_range(&mut self, key: &SourceRangeKey, value: u32) -> Result<(), DatapathError> {
        self.tc
            .source_ranges()
            .insert(&Key::new(key.0, key.1), value, 0)
            .map_err(|e| tc_err("update", "TC_SOURCE_RANGES", e))
    }
    fn delete_source_range(&mut self, key: &SourceRangeKey) -> Result<(), DatapathError> {
        absent_ok(self.tc.source_ranges().remove(&Key::new(key.0, key.1)))
            .map_err(|e| tc_err("delete", "TC_SOURCE_RANGES", e))
    }
    fn put_iface_addr(&mut self, ifindex: u32, value: &IfaceAddr) -> Result<(), DatapathError> {
        self.tc
            .iface_addrs()
            .insert(ifindex, value, 0)
            .map_err(|e| tc_err("update", "TC_IFACE_ADDRS", e))
    }
    fn delete_iface_addr(&mut self, ifindex: u32) -> Result<(), DatapathError> {
        absent_ok(self.tc.iface_addrs().remove(&ifindex))
            .map_err(|e| tc_err("delete", "TC_IFACE_ADDRS", e))
    }
    fn put_dsr(&mut self, key: &DsrKey, value: &DsrTarget) -> Result<(), DatapathError> {
        self.tc
            .dsr()
            .insert(key, value, 0)
            .map_err(|e| tc_err("update", "TC_DSR", e))
    }
    fn delete_dsr(&mut self, key: &DsrKey) -> Result<(), DatapathError> {
        absent_ok(self.tc.dsr().remove(key)).map_err(|e| tc_err("delete", "TC_DSR", e))
    }
}

impl Interfaces for KernelDatapath {
    fn interfaces(&self) -> anyhow::Result<BTreeMap<String, Interface>> {
        Ok(tc::interface_addresses()?
            .into_iter()
            .filter_map(|(name, addrs)| {
                let index = tc::if_index(&name)?;
                Some((name, Interface { index, addrs }))
            })
            .collect())
    }
    fn route_device(&self, ip: &IpAddr) -> Option<String> {
        tc::route_device(ip)
    }
    fn attached(&self) -> BTreeSet<String> {
        self.tc.attached()
    }
    fn attach(&mut self, name: &str, external: bool) -> anyhow::Result<Option<XdpMode>> {
        self.tc.attach(name, external)
    }
    fn detach(&mut self, name: &str) -> anyhow::Result<()> {
        self.tc.detach(name)
    }
}

impl super::FlowCollection for KernelDatapath {
    fn collect_lc_flows(&mut self) -> anyhow::Result<usize> {
        // The same periodic pass takes the egress program away once no socket is stale; a
        // failure leaves it attached (harmless) and is retried on the next pass.
        match self.maps.detach_egress_when_idle() {
            Ok(true) => {
                tracing::debug!("no stale connected UDP socket left: egress program detached")
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "detaching the idle egress program failed"),
        }
        self.tc.collect_lc_flows()
    }
}

impl HealthServers for KernelDatapath {
    fn serve_health(&mut self, port: u16, check: &HealthCheck) -> std::io::Result<()> {
        self.health.serve_health(port, check)
    }
    fn update_health(&mut self, port: u16, check: &HealthCheck) {
        self.health.update_health(port, check)
    }
    fn stop_health(&mut self, port: u16) {
        self.health.stop_health(port)
    }
}
