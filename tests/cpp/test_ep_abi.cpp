// The expert-parallel C ABI without GPUs: buffer and workspace sizes, and clear errors for
// groups that cannot work (world size, expert count, knobs), before anything is launched.
#include <gtest/gtest.h>

#include <string>

#include "megamoe/megamoe.h"

namespace {

megamoe_ep_group valid_group() {
  megamoe_ep_group g{};
  g.rank = 1;
  g.world_size = 2;
  g.num_experts = 16;
  g.max_tokens_per_rank = 1000;
  g.topk = 4;
  g.hidden = 512;
  g.max_recv_rows = 2 * 1000 * 4;
  g.timeout_ns = 1'000'000'000;
  return g;
}

void expect_invalid(const megamoe_ep_group& g, const std::string& fragment) {
  size_t bytes = 0;
  EXPECT_EQ(megamoe_ep_buffer_size(&g, &bytes), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(megamoe_last_error()).find(fragment), std::string::npos)
      << megamoe_last_error();
}

TEST(EpAbi, SizesOfAValidGroup) {
  const megamoe_ep_group g = valid_group();
  size_t buffer = 0, forward = 0, backward = 0, error = 0;
  ASSERT_EQ(megamoe_ep_buffer_size(&g, &buffer), MEGAMOE_SUCCESS) << megamoe_last_error();
  // At least the received tokens (x and dy) and the combine area: 3 x W x T x H bf16.
  EXPECT_GE(buffer, size_t{3} * 2 * 1000 * 512 * 2);
  ASSERT_EQ(megamoe_ep_workspace_size(&g, 1000, 256, &forward), MEGAMOE_SUCCESS);
  ASSERT_EQ(megamoe_ep_backward_workspace_size(&g, 1000, 256, 0, &backward), MEGAMOE_SUCCESS);
  size_t backward_saved = 0;  // saved mode: no room for a recomputed h
  ASSERT_EQ(megamoe_ep_backward_workspace_size(&g, 1000, 256, 1, &backward_saved),
            MEGAMOE_SUCCESS);
  EXPECT_GT(forward, 0u);
  EXPECT_GT(backward, forward);
  EXPECT_EQ(backward - backward_saved, size_t{2} * 1000 * 4 * 2 * 256 * 2);  // [R, 2I] bf16
  ASSERT_EQ(megamoe_ep_error_offset(&g, &error), MEGAMOE_SUCCESS);
  EXPECT_LT(error, buffer);
  megamoe_ep_group more_sms = g;
  more_sms.num_comm_sms = 16;  // the knob changes no size
  size_t same = 0;
  ASSERT_EQ(megamoe_ep_buffer_size(&more_sms, &same), MEGAMOE_SUCCESS);
  EXPECT_EQ(same, buffer);
}

TEST(EpAbi, RejectsGroupsThatCannotWork) {
  megamoe_ep_group g = valid_group();
  g.world_size = 9;
  expect_invalid(g, "world_size");
  g = valid_group();
  g.num_experts = 15;
  expect_invalid(g, "num_experts 15");
  g = valid_group();
  g.num_comm_sms = -1;
  expect_invalid(g, "num_comm_sms");
  g = valid_group();
  g.topk = 17;
  expect_invalid(g, "1 <= k <= 16");
  g = valid_group();
  g.rank = 2;
  expect_invalid(g, "rank 2 of 2");
}

}  // namespace
