//! Exact-id scenarios for the page pool: allocation order, free-queue placement
//! (unhashed pages to the front, cached pages to the back), eviction, touch.

use resin_core::{BlockHash, PagePool};

fn h(n: u32) -> BlockHash {
    BlockHash::chain(None, &[n], 0)
}

#[test]
fn fresh_pool_hands_out_pages_in_order_and_never_page_zero() {
    let mut pool = PagePool::new(5, 1).unwrap();
    assert_eq!(pool.free_queue(), vec![1, 2, 3, 4]);
    assert_eq!(pool.num_free_pages(), 4);
    let got: Vec<u32> = (0..4).map(|_| pool.allocate().unwrap()).collect();
    assert_eq!(got, vec![1, 2, 3, 4]);
    assert_eq!(pool.allocate(), None);
    assert_eq!(pool.usage(), 1.0);
    pool.check_integrity(&[0, 1, 1, 1, 1]).unwrap();
}

#[test]
fn unhashed_pages_go_to_the_front_cached_pages_to_the_back() {
    let mut pool = PagePool::new(8, 1).unwrap();
    let (a, b, c) = (pool.allocate().unwrap(), pool.allocate().unwrap(), pool.allocate().unwrap());
    assert_eq!((a, b, c), (1, 2, 3));
    assert!(pool.cache_page(a, 0, h(1)));
    assert!(pool.cache_page(c, 0, h(3)));
    // Freed like a request frees: tail first.
    pool.release(c);
    pool.release(b);
    pool.release(a);
    // b (unhashed) is reused first; c then a (cached) are evicted last, tail before head.
    assert_eq!(pool.free_queue(), vec![2, 4, 5, 6, 7, 3, 1]);
    assert_eq!(pool.lookup(0, h(1)), Some(1));
    assert!(pool.is_idle(1));
    pool.check_integrity(&[0; 8]).unwrap();
}

#[test]
fn allocating_a_cached_page_evicts_its_hash() {
    let mut pool = PagePool::new(3, 1).unwrap();
    let a = pool.allocate().unwrap();
    pool.cache_page(a, 0, h(9));
    pool.release(a);
    assert_eq!(pool.free_queue(), vec![2, 1]);
    assert_eq!(pool.allocate(), Some(2));
    assert_eq!(pool.allocate(), Some(1));
    assert_eq!(pool.lookup(0, h(9)), None);
    assert_eq!(pool.num_cached_pages(), 0);
    pool.check_integrity(&[0, 1, 1]).unwrap();
}

#[test]
fn touch_revives_an_idle_cached_page_and_counts_owners() {
    let mut pool = PagePool::new(4, 1).unwrap();
    let a = pool.allocate().unwrap();
    pool.cache_page(a, 0, h(1));
    pool.release(a);
    assert_eq!(pool.free_queue(), vec![2, 3, 1]);
    pool.touch(1);
    pool.touch(1);
    assert_eq!(pool.ref_count(1), 2);
    assert_eq!(pool.free_queue(), vec![2, 3]);
    pool.check_integrity(&[0, 2, 0, 0]).unwrap();
    assert!(pool.check_integrity(&[0, 1, 0, 0]).is_err(), "refcount must equal owners");
    pool.release(1);
    pool.release(1);
    assert_eq!(pool.free_queue(), vec![2, 3, 1]);
}

#[test]
fn duplicate_hash_keeps_the_first_page_and_groups_are_separate() {
    let mut pool = PagePool::new(5, 2).unwrap();
    let (a, b) = (pool.allocate().unwrap(), pool.allocate().unwrap());
    assert!(pool.cache_page(a, 0, h(1)));
    assert!(!pool.cache_page(b, 0, h(1)), "second page with the same hash stays unhashed");
    assert!(pool.cache_page(b, 1, h(1)), "another group has its own map");
    assert_eq!(pool.lookup(0, h(1)), Some(a));
    assert_eq!(pool.lookup(1, h(1)), Some(b));
    pool.reset_prefix_cache();
    assert_eq!(pool.lookup(0, h(1)), None);
    assert_eq!(pool.num_cached_pages(), 0);
    pool.release(a);
    pool.release(b);
    assert_eq!(pool.free_queue(), vec![2, 1, 3, 4], "after a reset freed pages are plain free pages");
    pool.check_integrity(&[0; 5]).unwrap();
}
