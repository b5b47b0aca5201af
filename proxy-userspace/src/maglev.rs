//! Maglev lookup tables (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
//! Balancer", NSDI 2016, section 3.4), computed by the agent for `source-hash` and `maglev`
//! Services and read by the data path as `entries[hash(client) % size]`.
//!
//! Each backend gets a permutation of the table positions from two hashes of its name
//! (`offset = h1 % M`, `skip = h2 % (M - 1) + 1`, position j = `(offset + j * skip) % M`);
//! backends take turns claiming their next free position until the table is full. With M
//! prime every permutation visits every position, each backend ends up with M/N entries
//! (within one), and removing one of N backends moves little more than its own 1/N share.
//!
//! Names are the backends' `address:port/PROTOCOL`, so every node computes the same table
//! for the same endpoints: a client hashes to the same backend whichever node it enters.

/// True when `n` is prime (trial division; table sizes are at most 65521).
pub fn is_prime(n: u32) -> bool {
    if n < 2 {
        return false;
    }
    let mut d = 2u32;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 1;
    }
    true
}

/// 64-bit FNV-1a of `data` from `seed`: stable across builds and machines (the table must
/// not change when the agent is upgraded).
fn fnv1a(seed: u64, data: &[u8]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in data {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // Final avalanche (splitmix64), so similar names give unrelated offsets.
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The Maglev table of size `m` (a prime) for `backends` (id, name): `m` backend ids.
/// Empty backends give a table of zeros (the data path then falls back to random, which
/// refuses for lack of slots).
pub fn table(backends: &[(u32, String)], m: u32) -> Vec<u32> {
    let m = m as usize;
    let mut entry = vec![0u32; m];
    if backends.is_empty() || m == 0 {
        return entry;
    }
    // Sorted by name: the table depends only on the set of backends.
    let mut backends: Vec<&(u32, String)> = backends.iter().collect();
    backends.sort_by(|a, b| a.1.cmp(&b.1));
    let perms: Vec<(usize, usize)> = backends
        .iter()
        .map(|(_, name)| {
            let offset = (fnv1a(0x5eed_0001, name.as_bytes()) % m as u64) as usize;
            let skip = (fnv1a(0x5eed_0002, name.as_bytes()) % (m as u64 - 1)) as usize + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0usize; backends.len()];
    let mut filled = vec![false; m];
    let mut n = 0;
    'fill: loop {
        for (i, (offset, skip)) in perms.iter().enumerate() {
            let mut c = (offset + next[i] * skip) % m;
            while filled[c] {
                next[i] += 1;
                c = (offset + next[i] * skip) % m;
            }
            filled[c] = true;
            entry[c] = backends[i].0;
            next[i] += 1;
            n += 1;
            if n == m {
                break 'fill;
            }
        }
    }
    entry
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn names(n: usize) -> Vec<(u32, String)> {
        (0..n)
            .map(|i| {
                (
                    i as u32 + 1,
                    format!("10.0.{}.{}:8080/TCP", i / 250, i % 250),
                )
            })
            .collect()
    }

    #[test]
    fn primes() {
        assert!(is_prime(16381) && is_prime(65521) && is_prime(251) && is_prime(7));
        assert!(!is_prime(16383) && !is_prime(65535) && !is_prime(1) && !is_prime(0));
    }

    #[test]
    fn every_backend_gets_its_share_within_a_few_percent() {
        for (n, m) in [(3usize, 251u32), (10, 16381), (100, 16381), (7, 65521)] {
            let t = table(&names(n), m);
            assert_eq!(t.len(), m as usize);
            let mut count: BTreeMap<u32, usize> = BTreeMap::new();
            for id in &t {
                *count.entry(*id).or_default() += 1;
            }
            assert_eq!(count.len(), n, "every backend present");
            let fair = m as f64 / n as f64;
            for (id, c) in count {
                let dev = (c as f64 - fair).abs() / fair;
                assert!(
                    dev < 0.05,
                    "n={n} m={m}: backend {id} has {c}, fair {fair:.1}"
                );
            }
        }
    }

    #[test]
    fn removing_one_of_n_moves_about_one_nth_of_the_clients() {
        let m = 16381;
        for n in [5usize, 10, 50] {
            let all = names(n);
            let before = table(&all, m);
            let removed = all[n / 2].0;
            let rest: Vec<(u32, String)> = all.iter().filter(|b| b.0 != removed).cloned().collect();
            let after = table(&rest, m);
            let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
            let own = before.iter().filter(|id| **id == removed).count();
            let frac = moved as f64 / m as f64;
            println!(
                "n={n}: {moved} of {m} entries moved ({:.2}%, 1/n = {:.2}%), {own} were the removed backend's",
                frac * 100.0,
                100.0 / n as f64
            );
            // Every entry of the removed backend moves; the others move little.
            assert!(moved >= own);
            assert!(frac < 1.6 / n as f64, "n={n}: {frac}");
        }
    }

    #[test]
    fn table_depends_only_on_the_set() {
        let mut a = names(8);
        let t1 = table(&a, 251);
        a.reverse();
        assert_eq!(t1, table(&a, 251));
        assert!(table(&[], 251).iter().all(|x| *x == 0));
    }
}
