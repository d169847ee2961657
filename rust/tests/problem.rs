//! The problem checks' memory helpers on hand-made layouts: the address range a strided view
//! touches, whether two ranges meet, and whether a view addresses one element twice (the checks
//! that refuse overlapping outputs use them; contract/ tests those refusals end to end).

use twinattn::problem::{byte_extent, extents_overlap, may_overlap_itself};

#[test]
fn self_overlap() {
    assert!(!may_overlap_itself(&[2, 3, 4, 5], &[60, 20, 5, 1]));
    assert!(!may_overlap_itself(&[2, 3, 4, 5], &[5, 40, 10, -1]));
    assert!(may_overlap_itself(&[2, 3, 4, 5], &[60, 0, 5, 1]));
    assert!(may_overlap_itself(&[2, 3, 4, 5], &[60, 20, 4, 1]));
    assert!(!may_overlap_itself(&[2, 1, 4, 5], &[20, 0, 5, 1]));
    assert!(!may_overlap_itself(&[0, 3, 4, 5], &[0, 0, 0, 0]));
}

#[test]
fn extents() {
    assert_eq!(byte_extent(100, &[2, 3], &[3, 1], 4), Some((100, 124)));
    assert_eq!(byte_extent(100, &[2, 3], &[-3, 1], 4), Some((88, 112)));
    assert_eq!(byte_extent(100, &[2, 0], &[3, 1], 4), None);
    assert!(extents_overlap(Some((0, 8)), Some((4, 12))));
    assert!(!extents_overlap(Some((0, 8)), Some((8, 12))));
}
