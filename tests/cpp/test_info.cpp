#include <gtest/gtest.h>

#include <string>

#include "megamoe/megamoe.h"

TEST(Info, VersionMatchesHeader) {
  EXPECT_STREQ(megamoe_version(), "0.1.0");
  EXPECT_EQ(megamoe_version_number(), MEGAMOE_VERSION_MAJOR * 10000 +
                                          MEGAMOE_VERSION_MINOR * 100 + MEGAMOE_VERSION_PATCH);
  EXPECT_EQ(megamoe_version_number(), 100);
}

TEST(Info, StatusNames) {
  EXPECT_STREQ(megamoe_status_name(MEGAMOE_SUCCESS), "MEGAMOE_SUCCESS");
  EXPECT_STREQ(megamoe_status_name(MEGAMOE_ERROR_INVALID_ARGUMENT),
               "MEGAMOE_ERROR_INVALID_ARGUMENT");
  EXPECT_STREQ(megamoe_status_name(MEGAMOE_ERROR_UNSUPPORTED), "MEGAMOE_ERROR_UNSUPPORTED");
  EXPECT_STREQ(megamoe_status_name(MEGAMOE_ERROR_CUDA), "MEGAMOE_ERROR_CUDA");
  EXPECT_STREQ(megamoe_status_name(MEGAMOE_ERROR_OUT_OF_MEMORY), "MEGAMOE_ERROR_OUT_OF_MEMORY");
  EXPECT_STREQ(megamoe_status_name(MEGAMOE_ERROR_CAPACITY), "MEGAMOE_ERROR_CAPACITY");
  EXPECT_STREQ(megamoe_status_name(MEGAMOE_ERROR_TIMEOUT), "MEGAMOE_ERROR_TIMEOUT");
  EXPECT_STREQ(megamoe_status_name(MEGAMOE_ERROR_INTERNAL), "MEGAMOE_ERROR_INTERNAL");
  EXPECT_STREQ(megamoe_status_name(static_cast<megamoe_status>(42)), "MEGAMOE_STATUS_UNKNOWN");
}

TEST(Info, DtypeSizes) {
  EXPECT_EQ(megamoe_dtype_size(MEGAMOE_DTYPE_FLOAT32), 4u);
  EXPECT_EQ(megamoe_dtype_size(MEGAMOE_DTYPE_FLOAT64), 8u);
  EXPECT_EQ(megamoe_dtype_size(MEGAMOE_DTYPE_BFLOAT16), 2u);
  EXPECT_EQ(megamoe_dtype_size(MEGAMOE_DTYPE_FLOAT16), 2u);
  EXPECT_EQ(megamoe_dtype_size(MEGAMOE_DTYPE_INT32), 4u);
  EXPECT_EQ(megamoe_dtype_size(MEGAMOE_DTYPE_INT64), 8u);
  EXPECT_EQ(megamoe_dtype_size(MEGAMOE_DTYPE_FLOAT8_E4M3), 1u);
  EXPECT_EQ(megamoe_dtype_size(static_cast<megamoe_dtype>(-1)), 0u);
  EXPECT_EQ(megamoe_dtype_size(static_cast<megamoe_dtype>(99)), 0u);
}

TEST(Info, DeviceCountNeverFailsWithoutGpu) {
  int32_t count = -1;
  ASSERT_EQ(megamoe_cuda_device_count(&count), MEGAMOE_SUCCESS) << megamoe_last_error();
  EXPECT_GE(count, 0);
  // Asking twice gives the same answer: no stale runtime error turns the second into a
  // failure.
  int32_t again = -1;
  ASSERT_EQ(megamoe_cuda_device_count(&again), MEGAMOE_SUCCESS) << megamoe_last_error();
  EXPECT_EQ(again, count);
}

TEST(Info, DeviceCountRejectsNull) {
  megamoe_clear_error();
  EXPECT_EQ(megamoe_cuda_device_count(nullptr), MEGAMOE_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(megamoe_last_error()).find("count"), std::string::npos);
}
